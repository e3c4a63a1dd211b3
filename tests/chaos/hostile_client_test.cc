// Hostile clients against the real `rendezvous` binary (a child process, so
// its peak RSS is its own VmHWM): requests built to exhaust memory, jobs
// filled to their caps, huge join timeouts, many jobs, and a seeded fuzzer
// of mutated requests.
//
// Each case passes when the hostile calls get errors with the right codes,
// the server's peak RSS stays under kRssBoundKib, a separate "canary" job
// forms a new round and uses its store after every phase, and the server
// still shuts down gracefully (exit 0) at the end.
//
// Every call has a deadline; nothing sleeps.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <future>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/grpcpp.h"
#include "proto/rendezvous.grpc.pb.h"
#include "tools/server_process.h"

namespace muster::chaos {
namespace {

namespace pb = ::muster::rendezvous::v1;
using Stub = pb::Rendezvous::Stub;
using ::google::protobuf::FieldDescriptor;
using ::google::protobuf::Message;

constexpr int64_t kRssBoundKib = 512 * 1024;
constexpr size_t kMiB = 1 << 20;

std::string ServerBinary() {
  for (const char* root : {"TEST_SRCDIR", "RUNFILES_DIR"}) {
    if (const char* dir = std::getenv(root)) {
      return absl::StrCat(dir, "/muster/rendezvous/rendezvous");
    }
  }
  return tools::ExecutableDir() + "/hostile_client_test.runfiles/muster/rendezvous/rendezvous";
}

std::unique_ptr<grpc::ClientContext> Deadline(absl::Duration timeout = absl::Seconds(10)) {
  auto context = std::make_unique<grpc::ClientContext>();
  context->set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  return context;
}

pb::JoinRequest JoinRequestFor(const std::string& job_id, uint32_t nodes,
                               const std::string& member_id = "") {
  pb::JoinRequest request;
  request.set_job_id(job_id);
  request.set_member_id(member_id);
  pb::JobConfig* config = request.mutable_config();
  config->set_min_nodes(nodes);
  config->set_max_nodes(nodes);
  config->set_join_timeout_ms(60'000);
  config->set_lease_ttl_ms(120'000);
  config->set_max_restarts(3);
  request.set_address("127.0.0.1");
  request.set_hostname("node");
  request.set_nproc(1);
  request.set_requested_rank(-1);
  return request;
}

std::string Describe(const grpc::Status& status) {
  return absl::StrCat("code ", status.error_code(), ": ", status.error_message());
}

bool Mentions(const grpc::Status& status, const std::string& text) {
  return status.error_message().find(text) != std::string::npos;
}

// The server under attack, a client channel that accepts large replies,
// and the canary job that must keep working.
class Target {
 public:
  Target() {
    tools::ServerProcessOptions options;
    options.binary = ServerBinary();
    options.extra_args = {"--max-jobs", "200", "--closed-retention", "0"};
    auto started = tools::ServerProcess::Start(options);
    INFO(started.status().ToString());
    REQUIRE(started.ok());
    server_ = *std::move(started);
    grpc::ChannelArguments arguments;
    arguments.SetMaxReceiveMessageSize(-1);
    channel_ = grpc::CreateCustomChannel(server_->endpoint(), grpc::InsecureChannelCredentials(),
                                         arguments);
    stub_ = pb::Rendezvous::NewStub(channel_);
    StartCanary();
  }

  Stub& stub() { return *stub_; }
  const std::shared_ptr<grpc::Channel>& channel() { return channel_; }

  // Joins a one-node job and returns its running round.
  uint64_t RunOneNodeJob(const std::string& job_id) {
    pb::JoinResponse joined;
    grpc::Status status = stub_->Join(Deadline().get(), JoinRequestFor(job_id, 1), &joined);
    INFO(Describe(status));
    REQUIRE(status.ok());
    REQUIRE(joined.state().phase() == pb::RUNNING);
    return joined.state().round();
  }

  grpc::Status Set(const std::string& job_id, uint64_t round, const std::string& key,
                   const std::string& value) {
    pb::SetRequest request;
    request.set_job_id(job_id);
    request.set_round(round);
    request.set_key(key);
    request.set_value(value);
    pb::SetResponse reply;
    return stub_->Set(Deadline().get(), request, &reply);
  }

  // The canary's two members re-join (ending their round), form the next
  // round, and pass a value through its store. Returns how long it took.
  absl::Duration CanaryRound() {
    const absl::Time start = absl::Now();
    pb::JoinResponse first;
    pb::JoinResponse second;
    grpc::Status status =
        stub_->Join(Deadline().get(), JoinRequestFor("canary", 2, canary_[0]), &first);
    INFO("canary join: " << Describe(status));
    REQUIRE(status.ok());
    absl::Time t_join1 = absl::Now();
    status = stub_->Join(Deadline().get(), JoinRequestFor("canary", 2, canary_[1]), &second);
    INFO("canary join: " << Describe(status));
    REQUIRE(status.ok());
    REQUIRE(second.state().phase() == pb::RUNNING);
    absl::Time t_join2 = absl::Now();
    const uint64_t round = second.state().round();
    REQUIRE(round > canary_round_);
    canary_round_ = round;
    const std::string value = absl::StrCat("round-", round);
    REQUIRE(Set("canary", round, "MASTER_PORT", value).ok());
    absl::Time t_set = absl::Now();
    pb::GetRequest get;
    get.set_job_id("canary");
    get.set_round(round);
    get.set_key("MASTER_PORT");
    get.set_wait_ms(5000);
    pb::GetResponse got;
    status = stub_->Get(Deadline().get(), get, &got);
    INFO("canary get: " << Describe(status));
    REQUIRE(status.ok());
    REQUIRE(got.value() == value);
    absl::Duration took = absl::Now() - start;
    if (took > absl::Seconds(1))
      WARN("slow canary round " << absl::FormatDuration(took) << " join1 "
                                << absl::FormatDuration(t_join1 - start) << " join2 "
                                << absl::FormatDuration(t_join2 - start) << " set "
                                << absl::FormatDuration(t_set - start));
    worst_canary_ = std::max(worst_canary_, took);
    return took;
  }

  // The canary's round completes (both members done), the server's peak
  // RSS is under the bound, and SIGTERM stops it with exit status 0.
  void Finish(const std::string& name) {
    for (const std::string& member : canary_) {
      pb::ReportDoneRequest done;
      done.set_job_id("canary");
      done.set_round(canary_round_);
      done.set_member_id(member);
      pb::ReportDoneResponse reply;
      grpc::Status status = stub_->ReportDone(Deadline().get(), done, &reply);
      INFO(Describe(status));
      REQUIRE(status.ok());
      if (member == canary_.back()) {
        REQUIRE(reply.state().phase() == pb::SUCCEEDED);
      }
    }
    absl::StatusOr<int64_t> peak = server_->PeakRssKib();
    REQUIRE(peak.ok());
    WARN(name << ": server peak RSS " << *peak / 1024 << " MiB (bound " << kRssBoundKib / 1024
              << " MiB); slowest canary round " << absl::FormatDuration(worst_canary_));
    CHECK(*peak < kRssBoundKib);
    REQUIRE(server_->Kill(SIGTERM).ok());
    absl::StatusOr<int> exit = server_->Wait(absl::Now() + absl::Seconds(20));
    REQUIRE(exit.ok());
    CHECK(WIFEXITED(*exit));
    CHECK(WEXITSTATUS(*exit) == 0);
  }

 private:
  void StartCanary() {
    pb::JoinResponse joined;
    for (int i = 0; i < 2; ++i) {
      grpc::Status status = stub_->Join(Deadline().get(), JoinRequestFor("canary", 2), &joined);
      INFO(Describe(status));
      REQUIRE(status.ok());
      canary_.push_back(joined.member_id());
    }
    REQUIRE(joined.state().phase() == pb::RUNNING);
    canary_round_ = joined.state().round();
  }

  std::unique_ptr<tools::ServerProcess> server_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<Stub> stub_;
  std::vector<std::string> canary_;
  uint64_t canary_round_ = 0;
  absl::Duration worst_canary_;
};

TEST_CASE("one MultiGet or Wait cannot make the server copy a value per name", "[chaos]") {
  Target target;
  const uint64_t round = target.RunOneNodeJob("hostile");
  REQUIRE(target.Set("hostile", round, "blob", std::string(kMiB, 'b')).ok());

  auto multi_get = [&](const std::vector<std::string>& keys) {
    pb::MultiGetRequest request;
    request.set_job_id("hostile");
    request.set_round(round);
    for (const std::string& key : keys) request.add_keys(key);
    pb::MultiGetResponse reply;
    return target.stub().MultiGet(Deadline().get(), request, &reply);
  };
  // 1500 names of one 1 MiB key: 24 KB asking for 1.5 GiB.
  grpc::Status status = multi_get(std::vector<std::string>(1500, "blob"));
  INFO(Describe(status));
  REQUIRE(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(Mentions(status, "--max-keys-per-request"));
  status = multi_get(std::vector<std::string>(1000, "blob"));
  INFO(Describe(status));
  REQUIRE(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(Mentions(status, "--max-response-bytes"));
  REQUIRE(multi_get(std::vector<std::string>(32, "blob")).ok());
  target.CanaryRound();

  // A blocked Wait naming the big key 999 times is re-checked on every
  // change to its job; a check must not copy the values.
  pb::WaitRequest too_many;
  too_many.set_job_id("hostile");
  too_many.set_round(round);
  for (int i = 0; i < 1500; ++i) too_many.add_keys("blob");
  pb::WaitResponse waited;
  status = target.stub().Wait(Deadline().get(), too_many, &waited);
  INFO(Describe(status));
  REQUIRE(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(Mentions(status, "--max-keys-per-request"));

  pb::WaitRequest blocked;
  blocked.set_job_id("hostile");
  blocked.set_round(round);
  for (int i = 0; i < 999; ++i) blocked.add_keys("blob");
  blocked.add_keys("gate");
  blocked.set_wait_ms(30'000);
  auto wait = std::async(std::launch::async, [&] {
    pb::WaitResponse reply;
    return target.stub().Wait(Deadline(absl::Seconds(40)).get(), blocked, &reply);
  });
  for (int i = 0; i < 50; ++i) {
    REQUIRE(target.Set("hostile", round, absl::StrCat("tick", i), "t").ok());
  }
  target.CanaryRound();
  REQUIRE(target.Set("hostile", round, "gate", "open").ok());
  REQUIRE(wait.wait_for(std::chrono::seconds(40)) == std::future_status::ready);
  status = wait.get();
  INFO(Describe(status));
  CHECK(status.ok());
  target.Finish("MultiGet/Wait");
}

TEST_CASE("one job cannot grow past its byte cap", "[chaos]") {
  Target target;
  const uint64_t round = target.RunOneNodeJob("hostile");
  grpc::Status status;
  int stored = 0;
  for (; stored < 200; ++stored) {
    status = target.Set("hostile", round, absl::StrCat("k", stored), std::string(kMiB, 'f'));
    if (!status.ok()) break;
    if (stored % 16 == 0) target.CanaryRound();
  }
  INFO(Describe(status));
  REQUIRE(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(Mentions(status, "--max-job-bytes"));
  WARN("filled the hostile job with " << stored << " values of 1 MiB");
  CHECK(stored < 64);
  target.CanaryRound();
  target.Finish("job bytes");
}

TEST_CASE("join timeouts are bounded and jobs are capped", "[chaos]") {
  Target target;
  for (int64_t timeout :
       {int64_t{3'600'001}, int64_t{1'000'000'000'000}, std::numeric_limits<int64_t>::max()}) {
    pb::JoinRequest request = JoinRequestFor("patient", 2);
    request.mutable_config()->set_join_timeout_ms(timeout);
    pb::JoinResponse joined;
    grpc::Status status = target.stub().Join(Deadline().get(), request, &joined);
    INFO(timeout << ": " << Describe(status));
    REQUIRE(status.error_code() == grpc::StatusCode::INVALID_ARGUMENT);
    CHECK(Mentions(status, "join_timeout_ms"));
    CHECK(Mentions(status, "--max-join-timeout-ms"));
  }
  target.CanaryRound();

  // Jobs that never gather fill --max-jobs; the canary, already a job,
  // keeps forming rounds.
  grpc::Status status;
  int created = 0;
  for (; created < 400; ++created) {
    pb::JoinResponse joined;
    status = target.stub().Join(Deadline().get(), JoinRequestFor(absl::StrCat("many", created), 2),
                                &joined);
    if (!status.ok()) break;
    if (created % 50 == 0) target.CanaryRound();
  }
  INFO(Describe(status));
  REQUIRE(status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED);
  CHECK(created == 199);  // --max-jobs 200, the canary included
  target.CanaryRound();
  target.Finish("join timeouts and jobs");
}

TEST_CASE("a huge id is not echoed whole: the reply keeps its code and the connection works",
          "[chaos]") {
  Target target;
  const std::string huge(70'000, 'x');
  for (int i = 0; i < 3; ++i) {
    pb::DescribeJobRequest describe;
    describe.set_job_id(huge);
    pb::DescribeJobResponse described;
    grpc::Status status = target.stub().DescribeJob(Deadline().get(), describe, &described);
    INFO(Describe(status).substr(0, 300));
    // Before: the whole id came back in grpc-message, and the client took
    // the reply as RESOURCE_EXHAUSTED "metadata size exceeds limit".
    REQUIRE(status.error_code() == grpc::StatusCode::NOT_FOUND);
    CHECK(status.error_message().size() < 1200);
    CHECK(Mentions(status, "bytes cut"));
    CHECK(Mentions(status, "not found"));

    pb::GetRequest get;
    get.set_job_id(huge);
    get.set_key(huge);
    pb::GetResponse got;
    status = target.stub().Get(Deadline().get(), get, &got);
    INFO(Describe(status).substr(0, 300));
    CHECK(status.error_code() != grpc::StatusCode::RESOURCE_EXHAUSTED);
    CHECK(status.error_message().size() < 1200);
    target.CanaryRound();
  }
  target.Finish("huge ids");
}

// ---- the fuzzer

// A random value for one field of a request: edge cases, long and odd
// strings, many repeats.
void MutateField(Message& message, std::mt19937_64& rng) {
  const auto* descriptor = message.GetDescriptor();
  if (descriptor->field_count() == 0) return;  // ListJobsRequest
  const FieldDescriptor* field = descriptor->field(rng() % descriptor->field_count());
  const auto* reflection = message.GetReflection();
  static const int64_t kEdges[] = {0,       -1,        1,         2,         255,
                                   1 << 20, INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN};
  int64_t number = rng() % 2 ? kEdges[rng() % 10] : static_cast<int64_t>(rng());
  static const size_t kLengths[] = {0, 1, 255, 256, 257, 4097, 70000};
  std::string text(kLengths[rng() % 7], static_cast<char>('!' + rng() % 90));
  if (rng() % 4 == 0 && !text.empty()) text[rng() % text.size()] = '/';
  if (field->is_repeated()) {
    if (field->type() != FieldDescriptor::TYPE_STRING &&
        field->type() != FieldDescriptor::TYPE_BYTES) {
      return;
    }
    std::string repeated = reflection->FieldSize(message, field) > 0
                               ? reflection->GetRepeatedString(message, field, 0)
                               : text;
    for (int i = rng() % 2000; i > 0; --i) {
      reflection->AddString(&message, field, repeated);
    }
    return;
  }
  switch (field->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT64:
      reflection->SetInt64(&message, field, number);
      break;
    case FieldDescriptor::CPPTYPE_UINT64:
      reflection->SetUInt64(&message, field, static_cast<uint64_t>(number));
      break;
    case FieldDescriptor::CPPTYPE_INT32:
      reflection->SetInt32(&message, field, static_cast<int32_t>(number));
      break;
    case FieldDescriptor::CPPTYPE_UINT32:
      reflection->SetUInt32(&message, field, static_cast<uint32_t>(number));
      break;
    case FieldDescriptor::CPPTYPE_BOOL:
      reflection->SetBool(&message, field, number % 2 != 0);
      break;
    case FieldDescriptor::CPPTYPE_STRING:
      reflection->SetString(&message, field, text);
      break;
    case FieldDescriptor::CPPTYPE_MESSAGE:
      MutateField(*reflection->MutableMessage(&message, field), rng);
      break;
    default:
      break;
  }
}

// Byte-level damage to a serialized request.
void MutateBytes(std::string& bytes, std::mt19937_64& rng) {
  if (bytes.empty()) bytes.push_back(static_cast<char>(rng()));
  size_t at = rng() % bytes.size();
  switch (rng() % 5) {
    case 0:
      bytes[at] = static_cast<char>(bytes[at] ^ (1 << (rng() % 8)));
      break;
    case 1:
      bytes[at] = static_cast<char>(rng());
      break;
    case 2:
      bytes.insert(at, std::string(1 + rng() % 8, static_cast<char>(rng())));
      break;
    case 3:
      bytes.erase(at, 1 + rng() % 8);
      break;
    default:  // a field claiming a huge length
      bytes += std::string("\x1a\xff\xff\xff\xff\x07", 6);
      break;
  }
}

struct Template {
  std::string method;
  std::unique_ptr<Message> request;
};

std::vector<Template> Templates(uint64_t round) {
  std::vector<Template> templates;
  auto add = [&](const std::string& method, Message* request) {
    templates.push_back(
        {"/muster.rendezvous.v1.Rendezvous/" + method, std::unique_ptr<Message>(request)});
  };
  add("Join", new pb::JoinRequest(JoinRequestFor("fuzz", 2)));
  auto keys = [&](auto* request) {
    request->set_job_id("hostile");
    request->set_round(round);
    return request;
  };
  auto* set = keys(new pb::SetRequest);
  set->set_key("k");
  set->set_value("v");
  add("Set", set);
  auto* get = keys(new pb::GetRequest);
  get->set_key("blob");
  get->set_wait_ms(50);
  add("Get", get);
  auto* multi = keys(new pb::MultiGetRequest);
  multi->add_keys("blob");
  multi->add_keys("k");
  add("MultiGet", multi);
  auto* wait = keys(new pb::WaitRequest);
  wait->add_keys("blob");
  wait->set_wait_ms(50);
  add("Wait", wait);
  auto* counter = keys(new pb::AddRequest);
  counter->set_key("n");
  counter->set_delta(1);
  add("Add", counter);
  auto* cas = keys(new pb::CompareAndSetRequest);
  cas->set_key("k");
  cas->set_desired("w");
  add("CompareAndSet", cas);
  auto* del = keys(new pb::DeleteRequest);
  del->set_key("k");
  add("Delete", del);
  auto* keep = new pb::KeepAliveRequest;
  keep->set_job_id("fuzz");
  keep->set_member_id("node-1");
  add("KeepAlive", keep);
  auto* failure = new pb::ReportFailureRequest;
  failure->set_job_id("hostile");
  failure->set_round(round);
  failure->set_member_id("node-1");
  add("ReportFailure", failure);
  auto* describe = new pb::DescribeJobRequest;
  describe->set_job_id("hostile");
  add("DescribeJob", describe);
  add("ListJobs", new pb::ListJobsRequest);
  return templates;
}

TEST_CASE("fuzzed requests get errors, not a crash or a hang", "[chaos]") {
  uint64_t seed = Catch::rngSeed() != 0 ? Catch::rngSeed() : std::random_device()();
  WARN("fuzz seed " << seed << " (rerun with --rng-seed " << seed << ")");
  std::mt19937_64 rng(seed);
  Target target;
  const uint64_t round = target.RunOneNodeJob("hostile");
  REQUIRE(target.Set("hostile", round, "blob", std::string(kMiB, 'b')).ok());
  std::vector<Template> templates = Templates(round);

  grpc::GenericStub generic(target.channel());
  grpc::CompletionQueue queue;
  constexpr int kInputs = 20000;
  constexpr int kInFlight = 64;
  std::map<grpc::StatusCode, int> codes;
  int unparseable = 0;
  const absl::Time start = absl::Now();
  int batches = 0;
  for (int sent = 0; sent < kInputs; sent += kInFlight, ++batches) {
    struct Call {
      grpc::ClientContext context;
      grpc::ByteBuffer reply;
      grpc::Status status;
      std::unique_ptr<grpc::GenericClientAsyncResponseReader> reader;
      bool parses = true;
      std::string method;
    };
    std::vector<std::unique_ptr<Call>> calls;
    for (int i = 0; i < kInFlight && sent + i < kInputs; ++i) {
      const Template& base = templates[rng() % templates.size()];
      std::unique_ptr<Message> request(base.request->New());
      request->CopyFrom(*base.request);
      for (int n = 1 + rng() % 3; n > 0; --n) MutateField(*request, rng);
      std::string bytes = request->SerializeAsString();
      auto call = std::make_unique<Call>();
      call->method = base.method;
      if (rng() % 2 == 0) {
        for (int n = 1 + rng() % 3; n > 0; --n) MutateBytes(bytes, rng);
        call->parses = request->ParseFromString(bytes);
        unparseable += call->parses ? 0 : 1;
      }
      call->context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
      grpc::Slice slice(bytes);
      grpc::ByteBuffer buffer(&slice, 1);
      call->reader = generic.PrepareUnaryCall(&call->context, base.method, buffer, &queue);
      call->reader->StartCall();
      call->reader->Finish(&call->reply, &call->status, call.get());
      calls.push_back(std::move(call));
    }
    for (size_t done = 0; done < calls.size(); ++done) {
      void* tag = nullptr;
      bool ok = false;
      REQUIRE(queue.AsyncNext(&tag, &ok, absl::ToChronoTime(absl::Now() + absl::Seconds(10))) ==
              grpc::CompletionQueue::GOT_EVENT);
      auto* call = static_cast<Call*>(tag);
      codes[call->status.error_code()]++;
      INFO(call->method << ": " << Describe(call->status));
      CHECK(call->status.error_code() != grpc::StatusCode::UNKNOWN);
      CHECK(call->status.error_message().find("metadata size") == std::string::npos);
      // gRPC answers a request it cannot parse with UNIMPLEMENTED; from a
      // request that parses, it or INTERNAL would be a server bug.
      if (call->parses) {
        CHECK(call->status.error_code() != grpc::StatusCode::UNIMPLEMENTED);
        CHECK(call->status.error_code() != grpc::StatusCode::INTERNAL);
      }
    }
    if (batches % 32 == 0) target.CanaryRound();
  }
  queue.Shutdown();
  void* tag = nullptr;
  bool ok = false;
  while (queue.Next(&tag, &ok)) {
  }
  std::string histogram;
  for (auto& [code, count] : codes) absl::StrAppend(&histogram, " ", code, ":", count);
  WARN(kInputs << " fuzzed requests (" << unparseable << " unparseable) in "
               << absl::FormatDuration(absl::Now() - start) << "; codes:" << histogram);
  target.CanaryRound();
  target.Finish("fuzz");
}

}  // namespace
}  // namespace muster::chaos
