"""Compile rules that need tools outside Bazel 4.2's built-in set.

cc_grpc_proto: protoc + grpc_cpp_plugin (Debian's protobuf-compiler-grpc)
    through a genrule, because the native proto rules would fetch
    @com_google_protobuf.
cuda_library: nvcc from /usr/local/cuda through a genrule; the object it
    makes is linked into a cc_library. Only built under --config=cuda.
"""

def cc_grpc_proto(name, src, grpc = True, deps = [], proto_imports = [],
                  visibility = None):
    """A cc_library for one .proto file, with its gRPC stubs if `grpc`.

    `proto_imports`: the .proto files `src` imports (by workspace path);
    their cc libraries go in `deps`.
    """
    base = src[:-len(".proto")]
    outs = [base + ".pb.h", base + ".pb.cc"]
    if grpc:
        outs += [base + ".grpc.pb.h", base + ".grpc.pb.cc"]
    cmd = "protoc --proto_path=. --cpp_out=$(GENDIR) "
    if grpc:
        cmd += ("--grpc_out=$(GENDIR) " +
                "--plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin) ")
    cmd += "$(location " + src + ")"
    native.genrule(
        name = name + "_gen",
        srcs = [src] + proto_imports,
        outs = outs,
        cmd = cmd,
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        deps = deps + ["//third_party:protobuf"] +
               (["//third_party:grpc"] if grpc else []),
        visibility = visibility,
    )

NVCC = "/usr/local/cuda/bin/nvcc"

def cuda_library(name, srcs, hdrs = [], includes = [], deps = [], visibility = None):
    """Compiles .cu files with nvcc into a cc_library.

    `hdrs` are this library's headers; `includes` are the other workspace
    headers the .cu files include (inputs of the nvcc genrule only; their
    own cc_library must be in `deps`). Code is built for sm_80 (A100) and
    sm_90a (H100, H200), with PTX for compute_90 so a newer GPU can JIT it.
    """
    objs = []
    for src in srcs:
        obj = src[:-len(".cu")] + ".cu.o"
        native.genrule(
            name = name + "_" + src.replace("/", "_").replace(".", "_"),
            srcs = [src] + hdrs + includes,
            outs = [obj],
            cmd = (NVCC + " -std=c++17 -O3 -lineinfo -Xcompiler -fPIC -I. " +
                   "-gencode=arch=compute_80,code=sm_80 " +
                   "-gencode=arch=compute_90a,code=sm_90a " +
                   "-gencode=arch=compute_90,code=compute_90 " +
                   "-c $(location " + src + ") -o $@"),
            # Built only when a --config=cuda target depends on it, so
            # `bazel build //...` needs no nvcc.
            tags = ["manual"],
        )
        objs.append(obj)
    native.cc_library(
        name = name,
        srcs = objs,
        hdrs = hdrs,
        deps = deps + ["//third_party:cuda"],
        tags = ["manual"],
        visibility = visibility,
    )
