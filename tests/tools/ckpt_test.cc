// `ckpt` as users run it, on checkpoints written by two thread-ranks:
// ls, verify (and a flipped byte), consolidate to llm.c's format, diff.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "launcher/worker_env.h"
#include "tests/launcher/harness.h"
#include "tests/worker/thread_ranks.h"
#include "worker/checkpoint/manifest.h"
#include "worker/checkpoint/reader.h"
#include "worker/data/data.h"
#include "worker/trainer/trainer.h"

namespace muster::testing {
namespace {

struct Result {
  int exit_code = -1;
  std::string out, err;
};

// `shell_prefix` runs in the shell first (a ulimit, say).
Result RunCkpt(const TempDir& dir, const std::vector<std::string>& args,
               const std::string& shell_prefix = "") {
  launcher::SpawnSpec spec;
  spec.argv = {"/bin/sh", "-c",
               shell_prefix + "exec \"$0\" \"$@\" >" + dir.File("out") + " 2>" + dir.File("err"),
               BinaryPath("tools/ckpt")};
  spec.argv.insert(spec.argv.end(), args.begin(), args.end());
  for (const auto& [key, value] : launcher::CurrentEnvironment())
    spec.env.push_back(key + "=" + value);
  auto child = launcher::Child::Spawn(spec);
  REQUIRE(child.ok());
  auto exit = child->WaitFor(absl::Seconds(60));
  REQUIRE(exit.has_value());
  return {exit->ShellCode(), ReadFile(dir.File("out")), ReadFile(dir.File("err"))};
}

// Trains 8 steps at world 2 with checkpoints at 4 and 8 in dir/`ckpt`, of
// a model of width `dim`; returns the final parameters.
std::vector<float> TrainTwoRanks(const TempDir& dir, int dim = 32,
                                 const std::string& ckpt = "ckpt") {
  std::vector<uint16_t> tokens;
  for (int i = 0; i < 4000; ++i) tokens.push_back("abcdefghijklm"[i % 13]);
  REQUIRE(worker::WriteTokenShard(dir.File("train_000.bin"), tokens).ok());
  worker::TrainConfig config;
  config.model = {2, 2, dim, 256, 16};
  config.data.train = dir.File("train_*.bin");
  config.data.micro_batch = 4;
  config.train.steps = 8;
  config.train.log_every = 1000;
  config.device = "cpu";
  config.checkpoint.dir = dir.File(ckpt);
  config.checkpoint.every = 4;
  std::vector<std::vector<float>> params(2);
  std::vector<absl::Status> statuses(2);
  worker::testing::RunRanks(2, [&](int rank, worker::ParallelStrategy* parallel) {
    worker::TrainerOptions options;
    options.log = std::tmpfile();
    options.strategy = parallel;
    auto trainer = worker::Trainer::Create(config, options);
    statuses[rank] = trainer.ok() ? (*trainer)->Run() : trainer.status();
    if (trainer.ok()) params[rank] = (*trainer)->model()->CopyParamsToHost();
  });
  REQUIRE(statuses[0].ok());
  REQUIRE(statuses[1].ok());
  return params[0];
}

TEST_CASE("ckpt ls, verify, consolidate and diff") {
  TempDir dir;
  std::vector<float> params = TrainTwoRanks(dir);
  const std::string step4 = dir.File("ckpt/step_00000004"), step8 = dir.File("ckpt/step_00000008");

  Result ls = RunCkpt(dir, {"ls", dir.File("ckpt")});
  CHECK(ls.exit_code == 0);
  CHECK(absl::StrContains(ls.out, "step_00000004"));
  CHECK(absl::StrContains(ls.out, "step_00000008"));
  Result list = RunCkpt(dir, {"list", dir.File("ckpt")});  // the alias
  CHECK(list.exit_code == 0);
  CHECK(list.out == ls.out);
  Result missing = RunCkpt(dir, {"ls", dir.File("nowhere")});
  CHECK(missing.exit_code == 1);
  CHECK(absl::StrContains(missing.err, dir.File("nowhere")));
  // Each checkpoint's lineage, which tells runs in one directory apart.
  auto manifest = worker::ReadManifest(worker::Env::Default(), step8);
  REQUIRE(manifest.ok());
  REQUIRE(manifest->lineage.size() >= 8);
  CHECK(absl::StrContains(ls.out, "LINEAGE"));
  CHECK(absl::StrContains(ls.out, manifest->lineage.substr(0, 8)));
  // One checkpoint where a directory of them is meant: said so, exit 2.
  Result one = RunCkpt(dir, {"ls", step8});
  CHECK(one.exit_code == 2);
  CHECK(absl::StrContains(one.err, step8 + " is one checkpoint"));
  // What resume passes over is named, not hidden: its disk use is accounted.
  std::filesystem::create_directory(dir.File("ckpt/.tmp_step_00000012"));
  std::filesystem::copy(step4, dir.File("ckpt/step_00000004.lineage_59cb0000"),
                        std::filesystem::copy_options::recursive);
  Result aside = RunCkpt(dir, {"ls", dir.File("ckpt")});
  CHECK(aside.exit_code == 0);
  CHECK(absl::StrContains(aside.out, "also .tmp_step_00000012: a save in progress"));
  CHECK(absl::StrContains(aside.out,
                          "also step_00000004.lineage_59cb0000: another run's checkpoint kept"));
  std::filesystem::remove_all(dir.File("ckpt/.tmp_step_00000012"));
  std::filesystem::remove_all(dir.File("ckpt/step_00000004.lineage_59cb0000"));

  Result verify = RunCkpt(dir, {"verify", step8});
  INFO(verify.err);
  CHECK(verify.exit_code == 0);
  CHECK(absl::StrContains(verify.out, "OK (step 8"));
  CHECK(absl::StrContains(verify.out, "saved by 2 ranks"));

  Result consolidate = RunCkpt(dir, {"consolidate", step8, "-o", dir.File("model.bin")});
  INFO(consolidate.err);
  REQUIRE(consolidate.exit_code == 0);
  auto model = worker::GptModel::Create({2, 2, 32, 256, 16}, 1, worker::Device::kCpu);
  REQUIRE(model.ok());
  REQUIRE((*model)->LoadLlmc(dir.File("model.bin")).ok());
  CHECK((*model)->CopyParamsToHost() == params);

  // A consolidate that dies part-way (here: the file size limit, 8 KiB
  // of a 140 KB model) leaves the previous output whole.
  const std::string before = ReadFile(dir.File("model.bin"));
  Result cut = RunCkpt(dir, {"consolidate", step4, "-o", dir.File("model.bin")}, "ulimit -f 8; ");
  CHECK(cut.exit_code != 0);
  CHECK(ReadFile(dir.File("model.bin")) == before);
  Result again = RunCkpt(dir, {"consolidate", step4, "-o", dir.File("model.bin")});
  CHECK(again.exit_code == 0);
  CHECK(ReadFile(dir.File("model.bin")) != before);  // step 4's weights now
  CHECK_FALSE(std::filesystem::exists(dir.File("model.bin.partial")));

  Result same = RunCkpt(dir, {"diff", step8, step8});
  CHECK(same.exit_code == 0);
  CHECK(absl::StrContains(same.out, "params/block1.qkvw"));
  CHECK(absl::StrContains(same.out, "(all)                                         0"));
  Result differ = RunCkpt(dir, {"diff", step4, step8});
  CHECK(differ.exit_code == 0);
  CHECK_FALSE(absl::StrContains(differ.out, "(all)                                         0\n"));
  // Checkpoints of another width: no tensor compares, which is neither 0
  // nor success.
  TrainTwoRanks(dir, 64, "wide");
  Result other = RunCkpt(dir, {"diff", step8, dir.File("wide/step_00000008")});
  CHECK(other.exit_code == 1);
  CHECK(absl::StrContains(other.out,
                          "params/block1.qkvw                shapes differ [96,32] vs "
                          "[192,64]\n"));
  CHECK(absl::StrContains(other.out, "(all)                             shapes differ\n"));
  CHECK(other.err == "ckpt: " + step8 + " and " + dir.File("wide/step_00000008") +
                         " are checkpoints of different models: 84 tensors differ in shape, 0 "
                         "are in only one\n");

  // Flip one byte of rank 1's file.
  const std::string data = step8 + "/rank_00001.bin";
  {
    std::fstream file(data, std::ios::in | std::ios::out | std::ios::binary);
    char byte = 0;
    file.seekg(12);
    file.read(&byte, 1);
    byte ^= 1;
    file.seekp(12);
    file.write(&byte, 1);
  }
  Result corrupt = RunCkpt(dir, {"verify", step8});
  CHECK(corrupt.exit_code == 1);
  CHECK(absl::StrContains(corrupt.err, data + ": CRC-32"));
  // A cut file: every command names its size and the manifest's.
  const std::string cut_dir = dir.File("cut");
  std::filesystem::copy(step4, cut_dir);
  const std::string cut_file = cut_dir + "/rank_00000.bin";  // consolidate reads it too
  const auto full = std::filesystem::file_size(cut_file);
  std::filesystem::resize_file(cut_file, 1000);
  const std::string says =
      absl::StrCat("ckpt: ", cut_file, ": 1000 bytes, the manifest says ", full, "\n");
  for (const char* command : {"verify", "diff", "consolidate"}) {
    INFO(command);
    std::vector<std::string> args = {command, cut_dir};
    if (command == std::string("diff")) args = {command, step4, cut_dir};
    if (command == std::string("consolidate")) args = {command, cut_dir, "-o", dir.File("m2")};
    Result cut_result = RunCkpt(dir, args);
    CHECK(cut_result.exit_code == 1);
    CHECK(cut_result.err == says);
  }

  Result no_output = RunCkpt(dir, {"consolidate", step8, "-o", ""});
  CHECK(no_output.exit_code == 2);
  CHECK(no_output.err == "ckpt: -o is empty: name the model file to write\n");
  Result usage = RunCkpt(dir, {"frobnicate"});
  CHECK(usage.exit_code == 2);
}

// The tensor of `manifest` named `name`.
worker::TensorRecord& TensorNamed(worker::Manifest& manifest, const std::string& name) {
  for (worker::TensorRecord& tensor : manifest.tensors) {
    if (tensor.name == name) return tensor;
  }
  FAIL("no tensor " << name);
  throw std::logic_error("unreachable");
}

// Copies checkpoint `from` to `to` with its manifest changed by `edit`;
// the data files are copied as they are.
void CopyWithManifest(const std::string& from, const std::string& to,
                      const std::function<void(worker::Manifest&)>& edit) {
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
  auto manifest = worker::ReadManifest(worker::Env::Default(), from);
  REQUIRE(manifest.ok());
  edit(*manifest);
  std::ofstream(to + "/manifest.json", std::ios::trunc) << worker::ManifestToJson(*manifest);
}

TEST_CASE("ckpt refuses a manifest that contradicts itself or its model, blaming no data file") {
  TempDir dir;
  TrainTwoRanks(dir);
  const std::string step8 = dir.File("ckpt/step_00000008");
  struct Damage {
    const char* what;
    std::function<void(worker::Manifest&)> edit;
    const char* says;
  };
  // Each passed `ckpt verify` before, and consolidate wrote wrong weights.
  const std::vector<Damage> damages = {
      {"a slice moved to the other file",
       [](worker::Manifest& m) { TensorNamed(m, "params/block0.ln1w").slices[0].file = 1; },
       "file rank_00000.bin: bytes 34816 to 34944 belong to no tensor's slice"},
      {"a slice's offset moved",
       [](worker::Manifest& m) { TensorNamed(m, "params/block0.ln1w").slices[0].offset -= 4; },
       "file rank_00000.bin: tensor params/block0.ln1w's slice at byte 34812 overlaps tensor "
       "params/embedding.wpe's"},
      {"a tensor left out", [](worker::Manifest& m) { m.tensors.erase(m.tensors.begin() + 5); },
       "belong to no tensor's slice"},
      {"a tensor listed twice", [](worker::Manifest& m) { m.tensors.push_back(m.tensors[5]); },
       "is listed twice"},
      {"a tensor renamed",
       [](worker::Manifest& m) { TensorNamed(m, "params/block0.ln1w").name = "params/block0.x"; },
       "no tensor params/block0.ln1w, which its model (layers 2, heads 2, dim 32, vocab 256, "
       "seq_len 16) has"},
      {"a shape transposed",
       [](worker::Manifest& m) {
         TensorNamed(m, "params/block0.qkvw").shape = {32, 96};
       },
       "tensor params/block0.qkvw has shape [32, 96]; its model"},
      {"a model dim changed", [](worker::Manifest& m) { m.model.seq_len = 17; },
       "config_hash does not match its model (layers 2, heads 2, dim 32, vocab 256, seq_len 17)"},
      {"a world size that is not the file count", [](worker::Manifest& m) { m.world_size = 5; },
       "world_size 5 but 2 files"},
  };
  for (size_t i = 0; i < damages.size(); ++i) {
    const Damage& damage = damages[i];
    INFO(damage.what);
    const std::string bad = dir.File(absl::StrCat("bad", i));
    CopyWithManifest(step8, bad, damage.edit);
    Result verify = RunCkpt(dir, {"verify", bad});
    CHECK(verify.exit_code == 1);
    CHECK(absl::StrContains(verify.err, bad + "/manifest.json: "));
    CHECK(absl::StrContains(verify.err, damage.says));
    Result consolidate = RunCkpt(dir, {"consolidate", bad, "-o", dir.File("model.bin")});
    CHECK(consolidate.exit_code == 1);
    CHECK(consolidate.err == verify.err);
    CHECK_FALSE(std::filesystem::exists(dir.File("model.bin")));
    // The data files are intact: no load may say their CRC is wrong.
    Result diff = RunCkpt(dir, {"diff", step8, bad});
    CHECK(diff.exit_code == 1);
    CHECK(diff.err == verify.err);
  }

  // A field no consistency check can tell, changed in the text: the
  // manifest's own checksum catches it.
  const std::string edited = dir.File("edited");
  std::filesystem::copy(step8, edited);
  std::string text = ReadFile(edited + "/manifest.json");
  const size_t sample = text.find("\"sample_index\": \"");
  REQUIRE(sample != std::string::npos);
  text.insert(sample + 17, "1");  // sample_index N reads as 1N
  std::ofstream(edited + "/manifest.json", std::ios::trunc) << text;
  Result changed = RunCkpt(dir, {"verify", edited});
  CHECK(changed.exit_code == 1);
  CHECK(absl::StrContains(changed.err, edited + "/manifest.json: manifest_crc32 is "));

  // A directory named for another step than its manifest's: resume and
  // retention order by the name.
  CopyWithManifest(step8, dir.File("ckpt/step_00000050"), [](worker::Manifest&) {});
  Result renamed = RunCkpt(dir, {"verify", dir.File("ckpt/step_00000050")});
  CHECK(renamed.exit_code == 1);
  CHECK(absl::StrContains(renamed.err, dir.File("ckpt/step_00000050") +
                                           "/manifest.json: step 8, but the directory is "
                                           "named for step 50"));
  Result listed = RunCkpt(dir, {"ls", dir.File("ckpt")});
  CHECK(listed.exit_code == 0);
  CHECK(absl::StrContains(listed.out, "named for step 50, holds step 8: resume skips it\n"));
}

}  // namespace
}  // namespace muster::testing
