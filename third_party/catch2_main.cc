// One translation unit holds Catch2's main() so each test file compiles fast.
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
