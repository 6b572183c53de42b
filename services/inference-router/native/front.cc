// opml-inference-front: the router's KServe v2 gRPC data plane in C++.
//
// Why: a grpc.aio call costs ~300 us of CPU in Python before any routing (docs/benchmarks.md,
// issue 12), most of what the router adds per request; this server costs ~55-90 us.
// This process terminates gRPC and hands each call to the router over one inherited Unix socket, in
// the worker's frame protocol (opml_inference_router/frames.py), so routing, admission, hedging,
// auth, the prediction log and the metrics stay in one place, the router's event loop. Frames queue
// in one buffer and leave in one send when the thread that reads calls off the wire has none left,
// so the router wakes once for a burst of calls.
//
// The direct path (opml_inference_router/data_plane; on when the router pushes a route table): a
// ModelInfer call of a model in the table, from a caller the router vouched for (a verdict it pushed
// after letting the credential's first call through), goes straight to a worker's Unix socket, to a
// replica with an admission token left (power of two choices on this front's calls in flight there;
// the router leases the tokens from the model's limiter); a backup goes to a second replica after
// the first one's p95 (the router's hedge budget); the worker's answer goes to the caller; a
// worker's non-retriable error is the caller's too; a retriable failure (the worker gone, busy,
// lacking the model) hands the call to the router, which retries and ejects. Every call is then
// reported to the router in batches (what the prediction log, metrics and admission need). A call
// the table does not cover (another version, a split, no token, no verdict) goes to the router.
//
// Threads: one polls the completion queue and runs every call's events and the direct path's timers
// (the asynchronous generic API, not the callback one: in gRPC 1.51 callbacks run on two "nexting"
// threads that pass each call between them, ~5 thread wake-ups a call against ~2 here and 15-25% more
// CPU at 8 callers); the main thread reads the router's answers and pushes and finishes the calls;
// one thread per worker connection reads its answers; one sends the reports (5 ms of them at a time);
// a signal thread stops the server. The grpc.health.v1.Health service is answered here too, by the
// same queue thread (Call::OnHealth), not by gRPC's default one: that one is callback-based, and a
// server with any callback method runs those two nexting threads, which poll the same sockets as the
// queue's thread, often read a call first and then wake it: a wake-up more per call (front CPU per
// request 0.266 -> 0.223 ms at 1 caller, 0.182 -> 0.130 ms at 8, bench/inference_router_tail.py).
//
// Link frames (little-endian): request  u32 body length, u32 call id, u8 kind, f64 timeout s (0: the
// caller set none), u16 credential length, credential (the caller's authorization header), body;
// kind 0 cancels call id (the caller went away); kind 7 is a report (data_plane/push.py reads it; never answered).
// Response: u32 body length, u32 call id, u8 status (a gRPC code), body (the response, or the error
// message); call id 0 is a push (route table, verdicts: text lines, Link::OnPush).
//
// Lifetime: the router starts it with --router-fd; the link closing (the router stopped or died)
// fails the calls in flight as UNAVAILABLE and stops the server, so this process never outlives the
// router. SIGTERM/SIGINT: health turns NOT_SERVING, calls in flight finish within --grace-s, exit.
// Once serving it prints {"port": N} on stdout (the bound port, for --listen host:0).

#include <absl/synchronization/mutex.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <queue>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace {

constexpr uint32_t kMaxFrame = 64u * 1024 * 1024;  // as gRPC's message limit on both sides
constexpr size_t kRequestHeader = 4 + 4 + 1 + 8 + 2;
constexpr size_t kResponseHeader = 4 + 4 + 1;
constexpr uint8_t kCancel = 0;
constexpr uint8_t kModelInfer = 1;
constexpr uint8_t kReport = 7;  // front -> router: what the direct path did (frames.REPORT)
constexpr uint32_t kPushId = 0;  // router -> front: a response frame with call id 0 is a push
constexpr uint8_t kOk = 0, kCancelledCode = 1, kDeadlineCode = 4;
const char kService[] = "/inference.GRPCInferenceService/";
const char kHealthService[] = "/grpc.health.v1.Health/";
// HealthCheckResponse.ServingStatus
constexpr uint8_t kServing = 1, kNotServing = 2, kServiceUnknown = 3;

// The GRPCInferenceService methods the router answers, and their frame kinds (frames.KINDS).
const std::unordered_map<std::string, uint8_t> kKinds = {
    {"ModelInfer", 1}, {"ModelMetadata", 2}, {"ModelReady", 3},
    {"ServerLive", 4}, {"ServerReady", 5},  {"ServerMetadata", 6},
};

using Clock = std::chrono::steady_clock;

void put_u32(std::string* out, uint32_t v) { out->append(reinterpret_cast<const char*>(&v), 4); }
void put_u16(std::string* out, uint16_t v) { out->append(reinterpret_cast<const char*>(&v), 2); }
void put_f64(std::string* out, double v) { out->append(reinterpret_cast<const char*>(&v), 8); }

void put_request_header(std::string* out, uint32_t length, uint32_t id, uint8_t kind, double timeout_s) {
  put_u32(out, length);
  put_u32(out, id);
  out->push_back(static_cast<char>(kind));
  put_f64(out, timeout_s);
  put_u16(out, 0);
}

// Writes all of `data` to a stream socket; false when the peer is gone.
bool SendAll(int fd, const std::string& data) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// --- protobuf wire format: the three header fields of a ModelInferRequest, as routing/wire.py reads
// them, and a HealthCheckRequest's service (its field 1).

bool ReadVarint(const std::string& data, size_t* pos, uint64_t* value) {
  *value = 0;
  for (int shift = 0; shift < 64 && *pos < data.size(); shift += 7) {
    uint8_t byte = static_cast<uint8_t>(data[(*pos)++]);
    *value |= static_cast<uint64_t>(byte & 0x7f) << shift;
    if (byte < 0x80) return true;
  }
  return false;
}

// String fields 1-3 (a ModelInferRequest's model_name, model_version, id; the last occurrence wins);
// false when malformed.
bool ReadHeader(const std::string& data, std::string fields[3]) {
  size_t pos = 0;
  while (pos < data.size()) {
    uint64_t key, value;
    if (!ReadVarint(data, &pos, &key)) return false;
    uint64_t number = key >> 3;
    switch (key & 7) {
      case 0:
        if (!ReadVarint(data, &pos, &value)) return false;
        break;
      case 1: pos += 8; break;
      case 5: pos += 4; break;
      case 2:
        if (!ReadVarint(data, &pos, &value) || value > data.size() - pos) return false;
        if (number >= 1 && number <= 3) fields[number - 1].assign(data, pos, value);
        pos += value;
        break;
      default: return false;
    }
  }
  return pos == data.size();
}

void AppendStringField(std::string* data, uint32_t number, const std::string& value) {
  uint64_t key = (number << 3) | 2, length = value.size();
  for (uint64_t v : {key, length}) {
    while (v > 0x7f) {
      data->push_back(static_cast<char>((v & 0x7f) | 0x80));
      v >>= 7;
    }
    data->push_back(static_cast<char>(v));
  }
  data->append(value);
}

// As wire.version_leads: a response whose model_version follows its (short) model_name.
bool VersionLeads(const std::string& data) {
  size_t pos = 0;
  if (!data.empty() && data[0] == '\x0a') {
    if (data.size() < 2 || static_cast<uint8_t>(data[1]) >= 0x80) return false;
    pos = 2 + static_cast<uint8_t>(data[1]);
  }
  return pos + 1 < data.size() && data[pos] == '\x12' && data[pos + 1] != '\0';
}

class Call;
class Worker;

// --- the route table the router pushes (data_plane/push.py renders it).

struct ReplicaRoute {
  std::string path;  // the worker's Unix socket
  int tokens = 0;    // requests this front may have in flight there (admission slots the router leased)
  double hedge_s = 0;  // a backup goes to another replica when this one has not answered by then
  std::shared_ptr<Worker> worker;
  std::shared_ptr<std::atomic<int>> spent;  // this front's requests in flight there (kept across tables)
};

struct ModelRoute {
  std::string name, version;
  uint64_t max_request = 0;
  double default_timeout_s = 0;
  bool hedge = false;
  double hedge_budget = 0;
  std::vector<ReplicaRoute> replicas;
};

struct Table {
  bool auth = true;  // callers' credentials are checked (a verdict in the cache, or the router's path)
  std::unordered_map<std::string, std::shared_ptr<const ModelRoute>> models;
};

class Link;
Link* g_link = nullptr;
std::string g_control_hint;  // where the rest of the router's API is, for UNIMPLEMENTED

// The one connection to the router: calls out (queued, sent together by Flush), answers and pushes
// in (the main thread reads), matched by call id.
class Link {
 public:
  explicit Link(int fd) : fd_(fd) {}

  // Queues the call's frame; its call id, or 0 when the link is down (the caller answers UNAVAILABLE).
  uint32_t Send(Call* call, uint8_t kind, double timeout_s, const std::string& credential,
                const std::string& body);
  // Forgets the call and queues the router's word to drop it; true when it was still waiting here.
  bool Cancel(uint32_t id);
  // Sends what is queued in one write. The queue's thread calls it when it has no event left to
  // run, so a burst of calls wakes the router once.
  void Flush();
  // Reads answers and pushes until the router closes the link, then fails whatever was left.
  void ReadLoop();
  bool down() {
    std::lock_guard<std::mutex> lock(mu_);
    return down_;
  }

 private:
  void OnPush(const std::string& body);

  const int fd_;
  std::mutex send_mu_;  // held across a send, taken before mu_: frames leave in the order queued
  std::mutex mu_;
  std::unordered_map<uint32_t, Call*> pending_;
  std::string out_;
  uint32_t next_id_ = 1;
  bool down_ = false;
};

// --- the direct path's state: the table, the verdicts, the workers, timers and the report.

class DirectPlane {
 public:
  std::shared_ptr<const Table> table() {
    std::lock_guard<std::mutex> lock(mu_);
    return table_;
  }
  void SetTable(std::shared_ptr<const Table> table) {
    std::lock_guard<std::mutex> lock(mu_);
    table_ = std::move(table);
  }
  // Whether the router said `credential` may call ModelInfer, and that verdict has not expired.
  bool Allowed(const std::string& credential) {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = verdicts_.find(credential);
    if (found == verdicts_.end()) return false;
    if (found->second < Clock::now()) {
      verdicts_.erase(found);
      return false;
    }
    return true;
  }
  void Allow(const std::string& credential, double ttl_s) {
    std::lock_guard<std::mutex> lock(mu_);
    if (verdicts_.size() >= 1024) verdicts_.clear();  // bounded, as the router's own cache
    verdicts_[credential] = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                               std::chrono::duration<double>(ttl_s));
  }
  // The model's hedge budget: `per_request` earned per request, at most 10, a backup spends one.
  bool TakeHedge(const ModelRoute& model) {
    std::lock_guard<std::mutex> lock(mu_);
    double& tokens = hedge_tokens_.try_emplace(model.name, 10.0).first->second;
    if (tokens < 1) return false;
    tokens -= 1;
    return true;
  }
  void EarnHedge(const ModelRoute& model) {
    std::lock_guard<std::mutex> lock(mu_);
    double& tokens = hedge_tokens_.try_emplace(model.name, 10.0).first->second;
    tokens = std::min(10.0, tokens + model.hedge_budget);
  }
  // The connection to the worker at `path`, kept across tables.
  std::shared_ptr<Worker> WorkerAt(const std::string& path);
  // The count of requests in flight of `model` at the worker at `path`, kept across tables.
  std::shared_ptr<std::atomic<int>> SpentAt(const std::string& model, const std::string& path) {
    std::lock_guard<std::mutex> lock(mu_);
    auto& spent = spent_[model + '\0' + path];
    if (!spent) spent = std::make_shared<std::atomic<int>>(0);
    return spent;
  }
  // Workers with frames queued by the completion-queue thread, sent when it has no event left.
  void Dirty(Worker* worker) {
    std::lock_guard<std::mutex> lock(dirty_mu_);
    dirty_.push_back(worker);
  }
  void FlushDirty();

  // Timers: a backup's time (hedge) and, for a caller without a deadline, the model's default. Run
  // by the completion-queue thread (the one that sets them) between its events and as its wait's
  // deadline, so a timer costs no thread of its own and no wake-up for calls answered before it.
  enum TimerKind { kHedge, kDeadline };
  void At(Clock::time_point when, Call* call, TimerKind kind) { timers_.push(Timer{when, call, kind}); }
  // Runs the timers due; drops those of calls already settled. When the next one is due, or max().
  Clock::time_point RunTimers();

  // One record for the router (queued; the report thread sends them together).
  void Report(std::string&& record) {
    {
      std::lock_guard<std::mutex> lock(report_mu_);
      report_.append(record);
    }
    report_cv_.notify_one();
  }
  void ReportLoop();
  // Sends what is reported now; false when the link is down.
  bool FlushReport();

 private:
  struct Timer {
    Clock::time_point when;
    Call* call;
    TimerKind kind;
    bool operator>(const Timer& other) const { return when > other.when; }
  };
  std::mutex mu_;
  std::shared_ptr<const Table> table_;
  std::unordered_map<std::string, Clock::time_point> verdicts_;
  std::unordered_map<std::string, double> hedge_tokens_;
  std::unordered_map<std::string, std::shared_ptr<Worker>> workers_;
  std::unordered_map<std::string, std::shared_ptr<std::atomic<int>>> spent_;
  std::mutex dirty_mu_;
  std::vector<Worker*> dirty_;
  std::priority_queue<Timer, std::vector<Timer>, std::greater<Timer>> timers_;  // the queue thread's
  std::mutex report_mu_;
  std::condition_variable report_cv_;
  std::string report_;
};

DirectPlane* g_plane = nullptr;

// grpc.health.v1.Health's status of service "" (the only one known): SERVING until the server stops.
// It keeps the Watch calls open so as to tell them then.
class Health {
 public:
  bool serving() {
    std::lock_guard<std::mutex> lock(mu_);
    return serving_;
  }
  // Keeps `call` to tell when the server stops; false (not kept) when it has stopped already.
  bool Watch(Call* call) {
    std::lock_guard<std::mutex> lock(mu_);
    if (serving_) watchers_.insert(call);
    return serving_;
  }
  void Forget(Call* call) {
    std::lock_guard<std::mutex> lock(mu_);
    watchers_.erase(call);
  }
  // NOT_SERVING from now on; every watcher is told and its stream ends (an open one would hold the
  // server's graceful shutdown until the grace period ends).
  void Stop();

 private:
  std::mutex mu_;
  bool serving_ = true;
  std::unordered_set<Call*> watchers_;
};

Health* g_health = nullptr;

// One connection to a worker's Unix socket: request frames out (queued, flushed together), response
// frames in on its own reader thread. Connects on first use and again after the worker closed it.
class Worker {
 public:
  explicit Worker(std::string path) : path_(std::move(path)) {}

  // Queues `body` (a ModelInferRequest) for `call`'s attempt `attempt`; false when the worker cannot
  // be reached (the caller takes another way). `now`: flush at once (not the queue's thread).
  bool Send(Call* call, int attempt, const std::string& body, double timeout_s, bool now);
  // Drops attempt `id` (the worker is told); false when its answer or loss is being delivered already.
  bool Cancel(uint32_t id, bool now);
  void Flush();
  const std::string& path() const { return path_; }

 private:
  bool ConnectLocked();
  void ReadLoop(int fd);

  const std::string path_;
  std::mutex send_mu_;  // held across a send, taken before mu_: frames leave in the order queued
  std::mutex mu_;
  int fd_ = -1;
  uint32_t next_id_ = 1;
  std::unordered_map<uint32_t, std::pair<Call*, int>> pending_;
  std::string out_;
};

std::shared_ptr<Worker> DirectPlane::WorkerAt(const std::string& path) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& worker = workers_[path];
  if (!worker) worker = std::make_shared<Worker>(path);
  return worker;
}

void DirectPlane::FlushDirty() {
  std::vector<Worker*> dirty;
  {
    std::lock_guard<std::mutex> lock(dirty_mu_);
    dirty.swap(dirty_);
  }
  for (Worker* worker : dirty) worker->Flush();
}

// One gRPC call on the completion queue: requested, its request read, then either sent straight to a
// worker (the direct path: a model whose route the router pushed) or handed to the router over the
// link, and finished with the answer; a health call is answered here (OnHealth). Its events come
// back from the queue as tags (this pointer, the event in the low 3 bits). Reference counted: the done
// notification holds one (it always comes once the call started), a started Finish one, a Watch's
// write in flight one, the link one while the call waits there, each attempt at a worker and each
// timer one; exactly one party (an answer, a cancel, a failure) claims the right to Finish.
class alignas(8) Call {
 public:
  enum Event : uintptr_t { kRequested = 0, kRead = 1, kFinished = 2, kDone = 3, kWritten = 4 };

  // Asks the server for the next call (on `cq`); its events go to the same queue.
  static void Request(grpc::AsyncGenericService* service, grpc::ServerCompletionQueue* cq) {
    Call* call = new Call(service, cq);
    call->ctx_.AsyncNotifyWhenDone(call->Tag(kDone));
    service->RequestCall(&call->ctx_, &call->stream_, cq, cq, call->Tag(kRequested));
  }

  // Runs one event from the queue (the queue's thread).
  static void Handle(void* tag, bool ok) {
    auto bits = reinterpret_cast<uintptr_t>(tag);
    Call* call = reinterpret_cast<Call*>(bits & ~uintptr_t{7});
    switch (static_cast<Event>(bits & 7)) {
      case kRequested:
        if (!ok) {  // the server is shutting down: this call never started, nor will its done event
          delete call;
          return;
        }
        Request(call->service_, call->cq_);
        call->stream_.Read(&call->request_, call->Tag(kRead));
        return;
      case kRead:
        call->OnRead(ok);
        return;
      case kFinished:
        call->Unref();
        return;
      case kWritten:
        call->OnWritten(ok);
        return;
      case kDone:
        if (call->watching_) g_health->Forget(call);
        if (call->ctx_.IsCancelled()) call->OnCancel();
        call->Unref();
        return;
    }
  }

  // The router's answer (on the link's reader thread); the link's reference is released here.
  void Answer(uint8_t status, std::string&& body) {
    if (status == kOk) {
      Respond(std::move(body));
    } else {
      Fail(static_cast<grpc::StatusCode>(status), body);
    }
    Unref();
  }

  void Fail(grpc::StatusCode code, const std::string& message) {
    if (Claim()) {
      refs_.fetch_add(1);  // the Finish's
      stream_.Finish(grpc::Status(code, message), Tag(kFinished));
    }
  }

  void Ref() { refs_.fetch_add(1); }
  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

  // The server stops (Health::Stop, another thread): a Watch of "" gets NOT_SERVING, and the stream
  // ends, now or once the write in flight is done.
  void OnHealthStop() {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    if (!writing_) EndWatchLocked();
  }

  // A worker's answer to attempt `index` (its reader thread), or its loss; the attempt's reference
  // is released here.
  void OnWorkerAnswer(int index, uint8_t status, std::string&& body);
  void OnTimer(DirectPlane::TimerKind kind);
  bool settled() const { return settled_.load(std::memory_order_relaxed); }

 private:
  struct Attempt {
    std::shared_ptr<Worker> worker;
    uint32_t id = 0;
    const ReplicaRoute* replica = nullptr;
    Clock::time_point sent;
    bool pending = false;
  };

  Call(grpc::AsyncGenericService* service, grpc::ServerCompletionQueue* cq)
      : service_(service), cq_(cq), stream_(&ctx_) {}

  void* Tag(Event event) { return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(this) | event); }

  void Respond(std::string&& body) {
    if (Claim()) {
      grpc::Slice slice(body);
      response_ = grpc::ByteBuffer(&slice, 1);
      refs_.fetch_add(1);  // the Finish's
      stream_.WriteAndFinish(response_, grpc::WriteOptions(), grpc::Status::OK, Tag(kFinished));
    }
  }

  void OnRead(bool ok) {
    if (!ok) {
      Fail(grpc::StatusCode::CANCELLED, "the caller sent no request");
      return;
    }
    const std::string& method = ctx_.method();
    if (method.rfind(kHealthService, 0) == 0) {
      OnHealth(method.substr(sizeof(kHealthService) - 1));
      return;
    }
    auto kind = method.rfind(kService, 0) == 0 ? kKinds.find(method.substr(sizeof(kService) - 1))
                                               : kKinds.end();
    if (kind == kKinds.end()) {
      Fail(grpc::StatusCode::UNIMPLEMENTED,
           method + " is not served on the router's inference port (it serves " +
               "inference.GRPCInferenceService: ModelInfer, ModelMetadata, ModelReady, ServerLive, " +
               "ServerReady, ServerMetadata); " + g_control_hint);
      return;
    }
    timeout_s_ = 0;
    auto deadline = ctx_.deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      timeout_s_ = std::chrono::duration<double>(deadline - std::chrono::system_clock::now()).count();
      if (timeout_s_ <= 0) {
        Fail(grpc::StatusCode::DEADLINE_EXCEEDED, "the deadline passed before the call was routed");
        return;
      }
    }
    auto& metadata = ctx_.client_metadata();
    auto auth = metadata.find("authorization");
    if (auth != metadata.end()) credential_.assign(auth->second.data(), auth->second.size());
    if (!ReadBody()) return;
    kind_ = kind->second;
    if (kind_ == kModelInfer && g_plane != nullptr && TryDirect()) return;
    ToRouter();
  }

  // The request's bytes into body_; false (the call failed) when they cannot be read.
  bool ReadBody() {
    std::vector<grpc::Slice> slices;
    if (!request_.Dump(&slices).ok()) {
      Fail(grpc::StatusCode::INTERNAL, "could not read the request");
      return false;
    }
    body_.reserve(request_.Length());
    for (const auto& slice : slices) body_.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    request_.Clear();
    return true;
  }

  // grpc.health.v1.Health (no credential needed, as gRPC's own): Check and Watch of service "", this
  // server; any other service is unknown (NOT_FOUND to Check, SERVICE_UNKNOWN to Watch).
  void OnHealth(const std::string& method) {
    bool watch = method == "Watch";
    if (!watch && method != "Check") {
      Fail(grpc::StatusCode::UNIMPLEMENTED, ctx_.method() + " is not a grpc.health.v1.Health method (Check, Watch)");
      return;
    }
    if (!ReadBody()) return;
    std::string fields[3];
    if (!ReadHeader(body_, fields)) {
      Fail(grpc::StatusCode::INVALID_ARGUMENT, "request: must be a grpc.health.v1.HealthCheckRequest");
      return;
    }
    health_service_ = std::move(fields[0]);
    if (!watch) {
      if (!health_service_.empty()) {
        Fail(grpc::StatusCode::NOT_FOUND, "unknown service " + health_service_ +
                                              "; the front serves health for service \"\"");
      } else {
        Respond(HealthResponse(g_health->serving() ? kServing : kNotServing));
      }
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    watching_ = g_health->Watch(this);
    uint8_t status = !health_service_.empty() ? kServiceUnknown : watching_ ? kServing : kNotServing;
    if (!watching_) {  // the server stops: the status, and the end
      Respond(HealthResponse(status));
      return;
    }
    writing_ = true;
    grpc::Slice slice(HealthResponse(status));
    response_ = grpc::ByteBuffer(&slice, 1);
    refs_.fetch_add(1);  // the write's
    stream_.Write(response_, Tag(kWritten));
  }

  // A HealthCheckResponse: field 1, the status.
  static std::string HealthResponse(uint8_t status) { return std::string{'\x08', static_cast<char>(status)}; }

  // A Watch's message is written; the stream ends here if the server stopped meanwhile. Not written
  // (the caller went away): the done event, cancelled, ends the call.
  void OnWritten(bool ok) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      writing_ = false;
      if (ok && stopping_) EndWatchLocked();
    }
    Unref();  // the write's
  }

  void EndWatchLocked() {
    if (health_service_.empty()) {
      Respond(HealthResponse(kNotServing));
    } else if (Claim()) {  // still SERVICE_UNKNOWN: nothing more to say
      refs_.fetch_add(1);  // the Finish's
      stream_.Finish(grpc::Status::OK, Tag(kFinished));
    }
  }

  // Hands the call to the router over the link (every call the direct path does not take).
  void ToRouter() {
    refs_.fetch_add(1);  // the link's
    id_ = g_link->Send(this, kind_, timeout_s_, credential_, body_);
    if (id_ == 0) {
      Unref();
      Fail(grpc::StatusCode::UNAVAILABLE, "the router is not reachable (it is stopping)");
    }
  }

  // The direct path: a model with a pushed route, a caller the router vouched for, a replica with an
  // admission token left. False: the router takes the call.
  bool TryDirect() {
    std::shared_ptr<const Table> table = g_plane->table();
    if (!table) return false;
    std::string fields[3];
    if (!ReadHeader(body_, fields) || fields[0].empty()) return false;
    auto found = table->models.find(fields[0]);
    if (found == table->models.end()) return false;
    const ModelRoute& model = *found->second;
    if (!fields[1].empty() && fields[1] != model.version) return false;  // another version: the router's
    if (body_.size() > model.max_request) return false;  // the router refuses it, naming the limit
    if (table->auth && !g_plane->Allowed(credential_)) return false;
    std::lock_guard<std::mutex> lock(mu_);
    const ReplicaRoute* replica = PickLocked(model, nullptr);
    if (replica == nullptr) return false;
    route_ = found->second;
    table_ = std::move(table);
    request_id_ = std::move(fields[2]);
    named_version_ = !fields[1].empty();
    received_ = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    started_ = Clock::now();
    direct_ = true;
    forwarded_ = body_;
    if (!named_version_) AppendStringField(&forwarded_, 2, model.version);
    double timeout = timeout_s_ > 0 ? timeout_s_ : model.default_timeout_s;
    if (!SendLocked(0, replica, timeout, false)) {
      direct_ = false;
      return false;
    }
    if (model.hedge) {
      g_plane->EarnHedge(model);
      if (model.replicas.size() > 1) {
        refs_.fetch_add(1);
        g_plane->At(started_ + std::chrono::duration_cast<Clock::duration>(
                                   std::chrono::duration<double>(replica->hedge_s)), this, DirectPlane::kHedge);
      }
    }
    if (timeout_s_ <= 0) {  // no caller deadline: the model's default ends the call (a gRPC deadline cancels it)
      refs_.fetch_add(1);
      g_plane->At(started_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout)),
                  this, DirectPlane::kDeadline);
    }
    return true;
  }

  // A replica of `model` with a token left (power of two choices on this front's requests in flight
  // there), never `exclude`.
  const ReplicaRoute* PickLocked(const ModelRoute& model, const ReplicaRoute* exclude) {
    const ReplicaRoute* candidates[2] = {nullptr, nullptr};
    int seen = 0;
    thread_local uint32_t seed = 0x9e3779b9u ^ static_cast<uint32_t>(reinterpret_cast<uintptr_t>(&seen));
    for (const auto& replica : model.replicas) {
      if (&replica == exclude || InFlight(model, replica) >= replica.tokens) continue;
      ++seen;  // reservoir sampling of two
      seed = seed * 1664525u + 1013904223u;
      if (seen <= 2) {
        candidates[seen - 1] = &replica;
      } else if ((seed >> 8) % seen < 2) {
        candidates[(seed >> 4) & 1] = &replica;
      }
    }
    if (seen == 0) return nullptr;
    if (seen == 1) return candidates[0];
    return InFlight(model, *candidates[0]) <= InFlight(model, *candidates[1]) ? candidates[0] : candidates[1];
  }

  static int InFlight(const ModelRoute&, const ReplicaRoute& replica) { return replica.spent->load(); }
  static void Spend(const ModelRoute&, const ReplicaRoute& replica, int delta) { replica.spent->fetch_add(delta); }

  bool SendLocked(int index, const ReplicaRoute* replica, double timeout_s, bool now) {
    Attempt& attempt = attempts_[index];
    attempt.worker = replica->worker;
    attempt.replica = replica;
    attempt.sent = Clock::now();
    attempt.pending = true;
    Spend(*route_, *replica, 1);
    refs_.fetch_add(1);  // the attempt's
    if (!replica->worker->Send(this, index, forwarded_, timeout_s, now)) {
      attempt.pending = false;
      Spend(*route_, *replica, -1);
      refs_.fetch_sub(1);
      return false;
    }
    attempt_count_ = index + 1;
    return true;
  }

  void SetAttemptId(int index, uint32_t id) { attempts_[index].id = id; }
  friend class Worker;

  // Ends the attempts still running (a winner answered, the caller left, the deadline passed).
  void CancelPendingLocked() {
    for (int i = 0; i < attempt_count_; ++i) {
      Attempt& attempt = attempts_[i];
      if (!attempt.pending) continue;
      attempt.pending = false;
      Spend(*route_, *attempt.replica, -1);
      if (attempt.worker->Cancel(attempt.id, true)) refs_.fetch_sub(1);  // the attempt's: no answer will come
    }
  }

  bool AnyPendingLocked() const {
    for (int i = 0; i < attempt_count_; ++i)
      if (attempts_[i].pending) return true;
    return false;
  }

  // A record of the report (data_plane/report.py reads it): u8 type (0: the call's outcome,
  // 1: an attempt failed, 2: a backup was sent), u8 status, u8 attempts, u8 backup won,
  // f64 received (unix s), f64 call s, f64 attempt s, u16 model, version, request id, replica
  // lengths, u32 request, response lengths, then those bytes.
  void RecordLocked(uint8_t type, uint8_t status, const Attempt* attempt, bool backup_won,
                    const std::string& request, const std::string& response) {
    std::string record;
    const std::string& replica = attempt != nullptr ? attempt->replica->path : std::string();
    record.reserve(48 + route_->name.size() + route_->version.size() + request_id_.size() + replica.size() +
                   request.size() + response.size());
    record.push_back(static_cast<char>(type));
    record.push_back(static_cast<char>(status));
    record.push_back(static_cast<char>(attempt_count_));
    record.push_back(static_cast<char>(backup_won));
    auto now = Clock::now();
    put_f64(&record, received_);
    put_f64(&record, std::chrono::duration<double>(now - started_).count());
    put_f64(&record, attempt != nullptr ? std::chrono::duration<double>(now - attempt->sent).count() : 0.0);
    const std::string* parts[] = {&route_->name, &route_->version, &request_id_, &replica};
    for (const std::string* part : parts)
      put_u16(&record, static_cast<uint16_t>(std::min<size_t>(part->size(), 0xffff)));
    put_u32(&record, static_cast<uint32_t>(request.size()));
    put_u32(&record, static_cast<uint32_t>(response.size()));
    for (const std::string* part : parts)
      record.append(part->data(), std::min<size_t>(part->size(), 0xffff));
    record.append(request);
    record.append(response);
    g_plane->Report(std::move(record));
  }

  void OnCancel() {
    if (direct_) {
      std::lock_guard<std::mutex> lock(mu_);
      if (!settled_) {
        settled_ = true;
        CancelPendingLocked();
        RecordLocked(0, kCancelledCode, nullptr, false, std::string(), std::string());
      }
    }
    if (id_ != 0 && g_link->Cancel(id_)) Unref();
    Fail(grpc::StatusCode::CANCELLED, "the caller cancelled the call");
  }

  bool Claim() { return !finished_.exchange(true); }

  grpc::AsyncGenericService* const service_;
  grpc::ServerCompletionQueue* const cq_;
  grpc::GenericServerContext ctx_;
  grpc::GenericServerAsyncReaderWriter stream_;
  grpc::ByteBuffer request_, response_;
  std::string body_, credential_;
  uint8_t kind_ = 0;
  double timeout_s_ = 0;
  std::atomic<uint32_t> id_{0};
  std::atomic<int> refs_{1};  // the done event's
  std::atomic<bool> finished_{false};
  // The direct path (guarded by mu_ once the first attempt is sent).
  std::mutex mu_;
  bool direct_ = false;
  std::atomic<bool> settled_{false};  // the direct path is done with the call (answered, to the router, failed)
  bool named_version_ = false;
  std::shared_ptr<const Table> table_;  // keeps route_'s replicas alive
  std::shared_ptr<const ModelRoute> route_;
  std::string forwarded_, request_id_;
  double received_ = 0;
  Clock::time_point started_;
  Attempt attempts_[2];
  int attempt_count_ = 0;
  // A health call: the service asked about; a Watch (guarded by mu_ once Health keeps it).
  std::string health_service_;
  bool watching_ = false;  // Health keeps it (the queue's thread sets and reads it)
  bool writing_ = false;   // a message is being written
  bool stopping_ = false;  // the server stops: the stream ends after the write in flight
};

void Health::Stop() {
  std::unordered_set<Call*> watchers;
  {
    std::lock_guard<std::mutex> lock(mu_);
    serving_ = false;
    watchers.swap(watchers_);
    for (Call* call : watchers) call->Ref();  // a watcher's done event waits on mu_ to Forget it
  }
  for (Call* call : watchers) {
    call->OnHealthStop();
    call->Unref();
  }
}


bool IsRetriable(uint8_t status) {  // routing/errors.py's RETRY, and a worker refusing credentials
  switch (status) {
    case 1: case 5: case 7: case 8: case 14: case 16: return true;
    default: return false;
  }
}

void Call::OnWorkerAnswer(int index, uint8_t status, std::string&& body) {
  bool to_router = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Attempt& attempt = attempts_[index];
    if (attempt.pending) {
      attempt.pending = false;
      Spend(*route_, *attempt.replica, -1);
      if (status == kOk) {
        if (!settled_) {
          settled_ = true;
          CancelPendingLocked();  // the loser of a hedge
          if (!VersionLeads(body)) AppendStringField(&body, 2, route_->version);
          RecordLocked(0, kOk, &attempt, index == 1, body_, body);
          Respond(std::move(body));
        }
      } else if (!IsRetriable(status)) {  // the caller's error (a bad tensor) or the deadline: passed on
        if (!settled_ && !AnyPendingLocked()) {
          settled_ = true;
          RecordLocked(0, status, &attempt, false, std::string(), std::string());
          Fail(static_cast<grpc::StatusCode>(status), body);
        }
      } else {  // the replica failed: the router ejects it, and answers the call unless a backup runs
        RecordLocked(1, status, &attempt, false, std::string(), body);
        if (!settled_ && !AnyPendingLocked()) {
          settled_ = true;
          to_router = true;
        }
      }
    }
  }
  if (to_router) {
    ToRouter();
    g_link->Flush();
  }
  Unref();
}

void Call::OnTimer(DirectPlane::TimerKind kind) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!settled_) {
      if (kind == DirectPlane::kDeadline) {
        settled_ = true;
        CancelPendingLocked();
        RecordLocked(0, kDeadlineCode, nullptr, false, std::string(), std::string());
        Fail(grpc::StatusCode::DEADLINE_EXCEEDED,
             "model '" + route_->name + "': no deadline from the caller, and the model's default timeout (" +
                 std::to_string(static_cast<int>(route_->default_timeout_s * 1000)) +
                 " ms) passed; set a deadline on the request or default_timeout_ms in model.yaml");
      } else if (attempt_count_ == 1 && attempts_[0].pending) {
        const ReplicaRoute* backup = PickLocked(*route_, attempts_[0].replica);
        if (backup != nullptr && g_plane->TakeHedge(*route_)) {
          double timeout = timeout_s_ > 0 ? timeout_s_ : route_->default_timeout_s;
          timeout -= std::chrono::duration<double>(Clock::now() - started_).count();
          if (timeout > 0 && SendLocked(1, backup, timeout, true))
            RecordLocked(2, kOk, &attempts_[1], false, std::string(), std::string());
        }
      }
    }
  }
  Unref();
}

bool Worker::ConnectLocked() {
  if (fd_ >= 0) return true;
  int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (path_.size() >= sizeof(address.sun_path)) {
    close(fd);
    return false;
  }
  std::memcpy(address.sun_path, path_.data(), path_.size());
  if (connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) {
    close(fd);
    return false;
  }
  fd_ = fd;
  std::thread([this, fd] { ReadLoop(fd); }).detach();  // workers live as long as the process
  return true;
}

bool Worker::Send(Call* call, int attempt, const std::string& body, double timeout_s, bool now) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!ConnectLocked()) return false;
    uint32_t id = next_id_++;
    if (next_id_ == 0) next_id_ = 1;
    call->SetAttemptId(attempt, id);
    pending_[id] = {call, attempt};
    bool first = out_.empty();
    put_request_header(&out_, static_cast<uint32_t>(body.size()), id, kModelInfer, timeout_s);
    out_.append(body);
    if (!now && first) g_plane->Dirty(this);
  }
  if (now) Flush();
  return true;
}

bool Worker::Cancel(uint32_t id, bool now) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (pending_.erase(id) == 0) return false;
    if (fd_ < 0) return true;
    bool first = out_.empty();
    put_request_header(&out_, 0, id, kCancel, 0);
    if (!now && first) g_plane->Dirty(this);
  }
  if (now) Flush();
  return true;
}

void Worker::Flush() {
  std::lock_guard<std::mutex> sending(send_mu_);
  std::string batch;
  int fd;
  {
    std::lock_guard<std::mutex> lock(mu_);
    batch.swap(out_);
    fd = fd_;
  }
  if (fd >= 0 && !batch.empty() && !SendAll(fd, batch)) shutdown(fd, SHUT_RDWR);  // the reader fails the calls
}

void Worker::ReadLoop(int fd) {
  std::vector<char> buffer(1 << 16);
  size_t filled = 0;
  for (;;) {
    if (filled == buffer.size()) buffer.resize(buffer.size() * 2);
    ssize_t n = read(fd, buffer.data() + filled, buffer.size() - filled);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    filled += static_cast<size_t>(n);
    size_t start = 0;
    bool bad = false;
    while (filled - start >= kResponseHeader) {
      uint32_t length, id;
      std::memcpy(&length, buffer.data() + start, 4);
      std::memcpy(&id, buffer.data() + start + 4, 4);
      uint8_t status = static_cast<uint8_t>(buffer[start + 8]);
      if (length > kMaxFrame) {
        bad = true;
        break;
      }
      if (filled - start - kResponseHeader < length) {
        if (start == 0 && kResponseHeader + length > buffer.size()) buffer.resize(kResponseHeader + length);
        break;
      }
      std::string body(buffer.data() + start + kResponseHeader, length);
      start += kResponseHeader + length;
      std::pair<Call*, int> waiting{nullptr, 0};
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto found = pending_.find(id);
        if (found != pending_.end()) {
          waiting = found->second;
          pending_.erase(found);
        }
      }
      if (waiting.first != nullptr) waiting.first->OnWorkerAnswer(waiting.second, status, std::move(body));
    }
    if (bad) break;
    std::memmove(buffer.data(), buffer.data() + start, filled - start);
    filled -= start;
  }
  std::unordered_map<uint32_t, std::pair<Call*, int>> left;
  {
    std::lock_guard<std::mutex> sending(send_mu_);
    std::lock_guard<std::mutex> lock(mu_);
    if (fd_ == fd) fd_ = -1;  // the next send connects again
    left.swap(pending_);
    out_.clear();
  }
  close(fd);
  for (auto& [id, waiting] : left)
    waiting.first->OnWorkerAnswer(waiting.second, 14, "the worker closed the connection (stopped or killed)");
}

Clock::time_point DirectPlane::RunTimers() {
  if (timers_.empty()) return Clock::time_point::max();
  auto now = Clock::now();
  while (!timers_.empty()) {
    Timer next = timers_.top();
    if (next.when > now && !next.call->settled()) return next.when;
    timers_.pop();
    next.call->OnTimer(next.kind);  // releases the timer's reference
  }
  return Clock::time_point::max();
}

void DirectPlane::ReportLoop() {
  // Every 5 ms at most: the router's prediction log, metrics and admission see the direct path's calls
  // a few ms late, and wake once for all of them.
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(report_mu_);
      report_cv_.wait(lock, [this] { return !report_.empty(); });
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    if (!FlushReport()) return;  // the link is down
  }
}

bool DirectPlane::FlushReport() {
  std::string batch;
  {
    std::lock_guard<std::mutex> lock(report_mu_);
    batch.swap(report_);
  }
  if (batch.empty()) return true;
  std::string none;
  if (g_link->Send(nullptr, kReport, 0, none, batch) == 0) return false;
  g_link->Flush();
  return true;
}

uint32_t Link::Send(Call* call, uint8_t kind, double timeout_s, const std::string& credential,
                    const std::string& body) {
  std::lock_guard<std::mutex> lock(mu_);
  if (down_) return 0;
  uint32_t call_id = next_id_++;
  if (next_id_ == 0) next_id_ = 1;  // 0 means "not sent" (and, from the router, a push)
  uint16_t credential_size = static_cast<uint16_t>(std::min<size_t>(credential.size(), 0xffff));
  out_.reserve(out_.size() + kRequestHeader + credential_size + body.size());
  put_u32(&out_, static_cast<uint32_t>(body.size()));
  put_u32(&out_, call_id);
  out_.push_back(static_cast<char>(kind));
  put_f64(&out_, timeout_s);
  put_u16(&out_, credential_size);
  out_.append(credential.data(), credential_size);
  out_.append(body);
  if (call != nullptr) pending_[call_id] = call;  // a report (no call) is never answered
  return call_id;
}

bool Link::Cancel(uint32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_.erase(id) == 0) return false;
  if (!down_) put_request_header(&out_, 0, id, kCancel, 0);
  return true;
}

void Link::Flush() {
  std::lock_guard<std::mutex> sending(send_mu_);
  std::string batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (down_) return;
    batch.swap(out_);
  }
  if (!batch.empty() && !SendAll(fd_, batch)) shutdown(fd_, SHUT_RDWR);  // the reader fails the calls
}

std::vector<std::string> SplitTabs(const std::string& line) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    size_t tab = line.find('\t', start);
    parts.push_back(line.substr(start, tab == std::string::npos ? std::string::npos : tab - start));
    if (tab == std::string::npos) return parts;
    start = tab + 1;
  }
}

std::string Unhex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

// A push (data_plane/push.py): lines of tab-separated fields.
//   table <auth 0|1>                    a new route table follows, replacing the last one
//   model <name> <version> <max request bytes> <default timeout s> <hedge 0|1> <hedge budget>
//   replica <socket path> <tokens> <hedge delay s>      (of the model above)
//   verdict <credential, hex> <ttl s>                   the credential may call ModelInfer
void Link::OnPush(const std::string& body) {
  std::istringstream lines(body);
  std::string line;
  std::shared_ptr<Table> table;
  std::shared_ptr<ModelRoute> model;
  auto finish_model = [&] {
    if (table && model) table->models[model->name] = model;
    model.reset();
  };
  try {
    while (std::getline(lines, line)) {
      std::vector<std::string> f = SplitTabs(line);
      if (f[0] == "table" && f.size() == 2) {
        table = std::make_shared<Table>();
        table->auth = f[1] == "1";
      } else if (f[0] == "model" && f.size() == 7 && table) {
        finish_model();
        model = std::make_shared<ModelRoute>();
        model->name = f[1];
        model->version = f[2];
        model->max_request = std::stoull(f[3]);
        model->default_timeout_s = std::stod(f[4]);
        model->hedge = f[5] == "1";
        model->hedge_budget = std::stod(f[6]);
      } else if (f[0] == "replica" && f.size() == 4 && model) {
        ReplicaRoute replica;
        replica.path = f[1];
        replica.tokens = std::stoi(f[2]);
        replica.hedge_s = std::stod(f[3]);
        replica.worker = g_plane->WorkerAt(replica.path);
        replica.spent = g_plane->SpentAt(model->name, replica.path);
        model->replicas.push_back(std::move(replica));
      } else if (f[0] == "verdict" && f.size() == 3) {
        g_plane->Allow(Unhex(f[1]), std::stod(f[2]));
      } else {
        std::fprintf(stderr, "opml-inference-front: ignored a push line of %zu fields\n", f.size());
      }
    }
  } catch (const std::exception&) {
    std::fprintf(stderr, "opml-inference-front: ignored a malformed push\n");
    return;
  }
  finish_model();
  if (table) g_plane->SetTable(std::move(table));
}

void Link::ReadLoop() {
  std::vector<char> buffer(1 << 20);
  size_t filled = 0;
  for (;;) {
    if (filled == buffer.size()) buffer.resize(buffer.size() * 2);
    ssize_t n = read(fd_, buffer.data() + filled, buffer.size() - filled);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    filled += static_cast<size_t>(n);
    size_t start = 0;
    while (filled - start >= kResponseHeader) {
      uint32_t length, call_id;
      std::memcpy(&length, buffer.data() + start, 4);
      std::memcpy(&call_id, buffer.data() + start + 4, 4);
      uint8_t status = static_cast<uint8_t>(buffer[start + 8]);
      if (length > kMaxFrame) {
        std::fprintf(stderr, "opml-inference-front: the router sent a %u-byte frame; closing\n", length);
        filled = start = 0;
        goto closed;
      }
      if (filled - start - kResponseHeader < length) {
        if (start == 0 && kResponseHeader + length > buffer.size()) buffer.resize(kResponseHeader + length);
        break;
      }
      std::string body(buffer.data() + start + kResponseHeader, length);
      start += kResponseHeader + length;
      if (call_id == kPushId) {
        OnPush(body);
        continue;
      }
      Call* call = nullptr;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto found = pending_.find(call_id);
        if (found != pending_.end()) {
          call = found->second;
          pending_.erase(found);
        }
      }
      if (call != nullptr) call->Answer(status, std::move(body));
    }
    std::memmove(buffer.data(), buffer.data() + start, filled - start);
    filled -= start;
  }
closed:
  g_plane->SetTable(nullptr);  // no router: no route is current
  std::unordered_map<uint32_t, Call*> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    down_ = true;
    left.swap(pending_);
  }
  for (auto& [id, call] : left) {
    call->Fail(grpc::StatusCode::UNAVAILABLE, "the router closed the data plane's link (it stopped)");
    call->Unref();
  }
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "opml-inference-front: cannot read %s\n", path.c_str());
    std::exit(2);
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

struct Options {
  std::string listen = "127.0.0.1:0", tls_cert, tls_key, tls_client_ca, control_hint;
  int router_fd = -1;
  int max_receive_bytes = 16 * 1024 * 1024;
  double grace_s = 10;
};

[[noreturn]] void Usage(const char* why) {
  std::fprintf(stderr,
               "opml-inference-front: %s\nusage: opml-inference-front --router-fd FD [--listen HOST:PORT] "
               "[--max-receive-bytes N] [--grace-s S] [--control-hint TEXT] [--tls-cert F --tls-key F "
               "[--tls-client-ca F]]\n",
               why);
  std::exit(2);
}

Options Parse(int argc, char** argv) {
  Options options;
  for (int i = 1; i < argc; i += 2) {
    std::string flag = argv[i];
    if (i + 1 >= argc) Usage(("no value for " + flag).c_str());
    std::string value = argv[i + 1];
    if (flag == "--listen") options.listen = value;
    else if (flag == "--router-fd") options.router_fd = std::stoi(value);
    else if (flag == "--max-receive-bytes") options.max_receive_bytes = std::stoi(value);
    else if (flag == "--grace-s") options.grace_s = std::stod(value);
    else if (flag == "--control-hint") options.control_hint = value;
    else if (flag == "--tls-cert") options.tls_cert = value;
    else if (flag == "--tls-key") options.tls_key = value;
    else if (flag == "--tls-client-ca") options.tls_client_ca = value;
    else Usage(("unknown flag " + flag).c_str());
  }
  if (options.router_fd < 0) Usage("--router-fd is required");
  if (options.tls_cert.empty() != options.tls_key.empty()) Usage("--tls-cert and --tls-key go together");
  return options;
}

std::shared_ptr<grpc::ServerCredentials> Credentials(const Options& options) {
  if (options.tls_cert.empty()) return grpc::InsecureServerCredentials();
  grpc::SslServerCredentialsOptions ssl(
      options.tls_client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                                    : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  ssl.pem_key_cert_pairs.push_back({ReadFile(options.tls_key), ReadFile(options.tls_cert)});
  if (!options.tls_client_ca.empty()) ssl.pem_root_certs = ReadFile(options.tls_client_ca);
  return grpc::SslServerCredentials(ssl);
}

}  // namespace

int main(int argc, char** argv) {
  Options options = Parse(argc, argv);
  g_control_hint = options.control_hint;
  // Debian builds abseil with its mutex deadlock detection on: a lock-order graph updated on every
  // lock gRPC takes, ~4% of this process's CPU. gRPC's own builds leave it off.
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  // Signals go to one thread (below), not to gRPC's: block them before any thread starts.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  pthread_sigmask(SIG_BLOCK, &stop_signals, nullptr);

  Health health;
  g_health = &health;
  grpc::AsyncGenericService front;
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen, Credentials(options), &port);
  builder.SetMaxReceiveMessageSize(options.max_receive_bytes);
  builder.SetMaxSendMessageSize(static_cast<int>(kMaxFrame));
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // a taken port is an error, not shared
  builder.RegisterAsyncGenericService(&front);
  std::unique_ptr<grpc::ServerCompletionQueue> cq = builder.AddCompletionQueue();
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    std::fprintf(stderr, "opml-inference-front: cannot listen on %s\n", options.listen.c_str());
    return 1;
  }
  Link link(options.router_fd);
  g_link = &link;
  DirectPlane plane;
  g_plane = &plane;
  std::thread([&] { plane.ReportLoop(); }).detach();
  // One thread polls the queue and runs every call's events: the thread that reads a call off the
  // wire also hands it to the link, with no wake-up of another thread in between, and sends the
  // frames of every call it read before it waits again in one write.
  Call::Request(&front, cq.get());
  std::thread calls([&] {
    void* tag;
    bool ok;
    for (;;) {
      Clock::time_point due = plane.RunTimers();
      auto next = cq->AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC));
      if (next == grpc::CompletionQueue::TIMEOUT) {  // nothing ready: send what the events queued, then wait
        plane.FlushDirty();
        link.Flush();
        if (due == Clock::time_point::max()) {
          if (!cq->Next(&tag, &ok)) break;
        } else {  // until the next event or the next timer
          int64_t wait_us = std::chrono::duration_cast<std::chrono::microseconds>(due - Clock::now()).count();
          next = cq->AsyncNext(&tag, &ok, gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                                                       gpr_time_from_micros(std::max<int64_t>(wait_us, 0), GPR_TIMESPAN)));
          if (next == grpc::CompletionQueue::TIMEOUT) continue;
          if (next == grpc::CompletionQueue::SHUTDOWN) break;
        }
      } else if (next == grpc::CompletionQueue::SHUTDOWN) {
        break;
      }
      Call::Handle(tag, ok);
    }
  });
  std::printf("{\"port\": %d}\n", port);
  std::fflush(stdout);

  std::atomic<bool> stopping{false};
  std::thread signals([&] {
    int received = 0;
    sigwait(&stop_signals, &received);
    if (stopping.exchange(true)) return;
    health.Stop();
    auto grace = std::chrono::system_clock::now() +
                 std::chrono::milliseconds(static_cast<int64_t>(options.grace_s * 1000));
    server->Shutdown(grace);  // in-flight calls finish (the link still answers), then the rest are cancelled
    plane.FlushReport();  // the last direct calls' records, before the link closes
    shutdown(options.router_fd, SHUT_RDWR);
  });
  signals.detach();

  link.ReadLoop();  // until the router closes the link (or the shutdown above closes it)
  if (!stopping.exchange(true)) {
    health.Stop();
    server->Shutdown(std::chrono::system_clock::now());
  }
  server->Wait();
  cq->Shutdown();  // after the server's: the thread above drains what is left, then ends
  calls.join();
  std::_Exit(0);  // the report thread and the workers' readers block in their reads
}
