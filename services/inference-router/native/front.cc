// opml-inference-front: the router's KServe v2 gRPC data plane in C++.
//
// Why: a grpc.aio call costs ~300 us of CPU in Python before any routing (docs/benchmarks.md,
// issue 12), most of what the router adds per request; this server costs ~55-90 us.
// This process only terminates gRPC: it takes GRPCInferenceService calls off the wire and hands each
// to the router over one inherited Unix socket, in the worker's frame protocol
// (opml_inference_router/frames.py), so routing, admission, hedging, auth, the prediction log and
// the metrics stay in one place, the router's event loop. Frames queue in one buffer and leave in one
// send when the thread that reads calls off the wire has none left, so the router wakes once for a
// burst of calls.
//
// Threads: one polls the completion queue and runs every call's events (the asynchronous generic
// API, not the callback one: in gRPC 1.51 callbacks run on two "nexting" threads that pass each call
// between them, ~5 thread wake-ups a call against ~2 here and 15-25% more CPU at 8 callers); the main
// thread reads the router's answers and finishes the calls; a signal thread stops the server.
//
// Link frames (little-endian): request  u32 body length, u32 call id, u8 kind, f64 timeout s (0: the
// caller set none), u16 credential length, credential (the caller's authorization header), body;
// kind 0 cancels call id (the caller went away). Response: u32 body length, u32 call id, u8 status
// (a gRPC code), body (the response, or the error message).
//
// Lifetime: the router starts it with --router-fd; the link closing (the router stopped or died)
// fails the calls in flight as UNAVAILABLE and stops the server, so this process never outlives the
// router. SIGTERM/SIGINT: health turns NOT_SERVING, calls in flight finish within --grace-s, exit.
// Once serving it prints {"port": N} on stdout (the bound port, for --listen host:0).

#include <absl/synchronization/mutex.h>
#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server.h>
#include <grpcpp/server_builder.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

constexpr uint32_t kMaxFrame = 64u * 1024 * 1024;  // as gRPC's message limit on both sides
constexpr size_t kRequestHeader = 4 + 4 + 1 + 8 + 2;
constexpr size_t kResponseHeader = 4 + 4 + 1;
constexpr uint8_t kCancel = 0;
const char kService[] = "/inference.GRPCInferenceService/";

// The GRPCInferenceService methods the router answers, and their frame kinds (frames.KINDS).
const std::unordered_map<std::string, uint8_t> kKinds = {
    {"ModelInfer", 1}, {"ModelMetadata", 2}, {"ModelReady", 3},
    {"ServerLive", 4}, {"ServerReady", 5},  {"ServerMetadata", 6},
};

void put_u32(std::string* out, uint32_t v) { out->append(reinterpret_cast<const char*>(&v), 4); }

class Call;

// The one connection to the router: calls out (queued, sent together by Flush), answers in (the main
// thread reads), matched by call id.
class Link {
 public:
  explicit Link(int fd) : fd_(fd) {}

  // Queues the call's frame; its call id, or 0 when the link is down (the caller answers UNAVAILABLE).
  uint32_t Send(Call* call, uint8_t kind, double timeout_s, const std::string& credential,
            const std::vector<grpc::Slice>& body, size_t body_size);
  // Forgets the call and queues the router's word to drop it; true when it was still waiting here.
  bool Cancel(uint32_t id);
  // Sends what is queued in one write. The queue's thread calls it when it has no event left to
  // run, so a burst of calls wakes the router once.
  void Flush();
  // Reads answers until the router closes the link, then fails whatever was left.
  void ReadLoop();

 private:
  const int fd_;
  std::mutex mu_;
  std::unordered_map<uint32_t, Call*> pending_;
  std::string out_;
  uint32_t next_id_ = 1;
  bool down_ = false;
};

Link* g_link = nullptr;
std::string g_control_hint;  // where the rest of the router's API is, for UNIMPLEMENTED

// One gRPC call on the completion queue: requested, its request read and handed to the link, then
// finished with what the router answers. Its events come back from the queue as tags (this pointer,
// the event in the low bits). Reference counted: the done notification holds one (it always comes
// once the call started), a started Finish one, the link one while the call waits there; exactly one
// party (the answer, a cancel, a failure) claims the right to Finish.
class Call {
 public:
  enum Event : uintptr_t { kRequested = 0, kRead = 1, kFinished = 2, kDone = 3 };

  // Asks the server for the next call (on `cq`); its events go to the same queue.
  static void Request(grpc::AsyncGenericService* service, grpc::ServerCompletionQueue* cq) {
    Call* call = new Call(service, cq);
    call->ctx_.AsyncNotifyWhenDone(call->Tag(kDone));
    service->RequestCall(&call->ctx_, &call->stream_, cq, cq, call->Tag(kRequested));
  }

  // Runs one event from the queue (the queue's thread).
  static void Handle(void* tag, bool ok) {
    auto bits = reinterpret_cast<uintptr_t>(tag);
    Call* call = reinterpret_cast<Call*>(bits & ~uintptr_t{3});
    switch (static_cast<Event>(bits & 3)) {
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
      case kDone:
        if (call->ctx_.IsCancelled()) call->OnCancel();
        call->Unref();
        return;
    }
  }

  // The router's answer (on the link's reader thread); the link's reference is released here.
  void Answer(uint8_t status, std::string&& body) {
    if (status == 0) {
      if (Claim()) {
        grpc::Slice slice(body);
        response_ = grpc::ByteBuffer(&slice, 1);
        refs_.fetch_add(1);  // the Finish's
        stream_.WriteAndFinish(response_, grpc::WriteOptions(), grpc::Status::OK, Tag(kFinished));
      }
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

  void Unref() {
    if (refs_.fetch_sub(1) == 1) delete this;
  }

 private:
  Call(grpc::AsyncGenericService* service, grpc::ServerCompletionQueue* cq)
      : service_(service), cq_(cq), stream_(&ctx_) {}

  void* Tag(Event event) { return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(this) | event); }

  void OnRead(bool ok) {
    if (!ok) {
      Fail(grpc::StatusCode::CANCELLED, "the caller sent no request");
      return;
    }
    const std::string& method = ctx_.method();
    auto kind = method.rfind(kService, 0) == 0 ? kKinds.find(method.substr(sizeof(kService) - 1))
                                               : kKinds.end();
    if (kind == kKinds.end()) {
      Fail(grpc::StatusCode::UNIMPLEMENTED,
           method + " is not served on the router's inference port (it serves " +
               "inference.GRPCInferenceService: ModelInfer, ModelMetadata, ModelReady, ServerLive, " +
               "ServerReady, ServerMetadata); " + g_control_hint);
      return;
    }
    double timeout_s = 0;
    auto deadline = ctx_.deadline();
    if (deadline != std::chrono::system_clock::time_point::max()) {
      timeout_s = std::chrono::duration<double>(deadline - std::chrono::system_clock::now()).count();
      if (timeout_s <= 0) {
        Fail(grpc::StatusCode::DEADLINE_EXCEEDED, "the deadline passed before the call was routed");
        return;
      }
    }
    std::string credential;
    auto& metadata = ctx_.client_metadata();
    auto auth = metadata.find("authorization");
    if (auth != metadata.end()) credential.assign(auth->second.data(), auth->second.size());
    std::vector<grpc::Slice> body;
    size_t size = request_.Length();
    if (!request_.Dump(&body).ok()) {
      Fail(grpc::StatusCode::INTERNAL, "could not read the request");
      return;
    }
    refs_.fetch_add(1);  // the link's
    id_ = g_link->Send(this, kind->second, timeout_s, credential, body, size);
    if (id_ == 0) {
      Unref();
      Fail(grpc::StatusCode::UNAVAILABLE, "the router is not reachable (it is stopping)");
    }
  }

  void OnCancel() {
    if (id_ != 0 && g_link->Cancel(id_)) Unref();
    Fail(grpc::StatusCode::CANCELLED, "the caller cancelled the call");
  }

  bool Claim() { return !finished_.exchange(true); }

  grpc::AsyncGenericService* const service_;
  grpc::ServerCompletionQueue* const cq_;
  grpc::GenericServerContext ctx_;
  grpc::GenericServerAsyncReaderWriter stream_;
  grpc::ByteBuffer request_, response_;
  std::atomic<uint32_t> id_{0};
  std::atomic<int> refs_{1};  // the done event's
  std::atomic<bool> finished_{false};
};

uint32_t Link::Send(Call* call, uint8_t kind, double timeout_s, const std::string& credential,
                const std::vector<grpc::Slice>& body, size_t body_size) {
  std::lock_guard<std::mutex> lock(mu_);
  if (down_) return 0;
  uint32_t call_id = next_id_++;
  if (next_id_ == 0) next_id_ = 1;  // 0 means "not sent"
  uint16_t credential_size = static_cast<uint16_t>(std::min<size_t>(credential.size(), 0xffff));
  out_.reserve(out_.size() + kRequestHeader + credential_size + body_size);
  put_u32(&out_, static_cast<uint32_t>(body_size));
  put_u32(&out_, call_id);
  out_.push_back(static_cast<char>(kind));
  out_.append(reinterpret_cast<const char*>(&timeout_s), 8);
  out_.append(reinterpret_cast<const char*>(&credential_size), 2);
  out_.append(credential.data(), credential_size);
  for (const auto& slice : body) out_.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
  pending_[call_id] = call;
  return call_id;
}

bool Link::Cancel(uint32_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (pending_.erase(id) == 0) return false;
  if (!down_) {
    put_u32(&out_, 0);
    put_u32(&out_, id);
    out_.push_back(static_cast<char>(kCancel));
    double zero = 0;
    out_.append(reinterpret_cast<const char*>(&zero), 8);
    uint16_t no_credential = 0;
    out_.append(reinterpret_cast<const char*>(&no_credential), 2);
  }
  return true;
}

void Link::Flush() {
  std::string batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (down_) return;
    batch.swap(out_);
  }
  size_t done = 0;
  while (done < batch.size()) {
    ssize_t n = send(fd_, batch.data() + done, batch.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      shutdown(fd_, SHUT_RDWR);  // the reader sees the end and fails the calls
      return;
    }
    done += static_cast<size_t>(n);
  }
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

  grpc::EnableDefaultHealthCheckService(true);
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
  // One thread polls the queue and runs every call's events: the thread that reads a call off the
  // wire also hands it to the link, with no wake-up of another thread in between, and sends the
  // frames of every call it read before it waits again in one write.
  Call::Request(&front, cq.get());
  std::thread calls([&] {
    void* tag;
    bool ok;
    for (;;) {
      auto next = cq->AsyncNext(&tag, &ok, gpr_time_0(GPR_CLOCK_MONOTONIC));
      if (next == grpc::CompletionQueue::TIMEOUT) {  // nothing ready: send what the events queued, then wait
        link.Flush();
        if (!cq->Next(&tag, &ok)) break;
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
    server->GetHealthCheckService()->SetServingStatus(false);
    auto grace = std::chrono::system_clock::now() +
                 std::chrono::milliseconds(static_cast<int64_t>(options.grace_s * 1000));
    server->Shutdown(grace);  // in-flight calls finish (the link still answers), then the rest are cancelled
    shutdown(options.router_fd, SHUT_RDWR);
  });
  signals.detach();

  link.ReadLoop();  // until the router closes the link (or the shutdown above closes it)
  if (!stopping.exchange(true)) {
    server->GetHealthCheckService()->SetServingStatus(false);
    server->Shutdown(std::chrono::system_clock::now());
  }
  server->Wait();
  cq->Shutdown();  // after the server's: the thread above drains what is left, then ends
  calls.join();
  return 0;
}
