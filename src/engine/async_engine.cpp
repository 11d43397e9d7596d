#include "engine/async_engine.h"

namespace moat {

uint64_t StreamSignal::rings() const {
  std::lock_guard lock(mu_);
  return rings_;
}

void StreamSignal::wait(uint64_t seen, std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return rings_ != seen; });
}

void StreamSignal::ring() {
  {
    std::lock_guard lock(mu_);
    ++rings_;
  }
  cv_.notify_all();
}

std::optional<RequestOutput> RequestStream::next(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mu_);
  cv_.wait_for(lock, timeout, [&] { return !queue_.empty() || finished_taken_; });
  if (queue_.empty()) return std::nullopt;
  RequestOutput out = std::move(queue_.front());
  queue_.pop_front();
  if (out.finished) finished_taken_ = true;
  return out;
}

bool RequestStream::finished() const {
  std::lock_guard lock(mu_);
  return finished_taken_;
}

void RequestStream::push(RequestOutput out) {
  {
    std::lock_guard lock(mu_);
    if (finished_pushed_) return;
    finished_pushed_ = out.finished;
    queue_.push_back(std::move(out));
  }
  cv_.notify_all();
  if (signal_) signal_->ring();
}

AsyncEngine::AsyncEngine(std::unique_ptr<Engine> engine, Options options)
    : engine_(std::move(engine)), options_(options) {
  publish_snapshot();
  thread_ = std::thread([this] { loop(); });
}

AsyncEngine::~AsyncEngine() { shutdown(false); }

std::variant<std::shared_ptr<RequestStream>, AsyncEngine::Refusal> AsyncEngine::submit(GenerateRequest request,
                                                                                  std::shared_ptr<StreamSignal> signal) {
  if (auto ok = engine_->validate(request); !ok) return Refusal{SubmitError::invalid, ok.error().message};
  std::shared_ptr<RequestStream> stream;
  {
    std::lock_guard lock(mu_);
    if (!accepting_) return Refusal{SubmitError::shutting_down, "the server is shutting down"};
    if (not_running_.load() >= options_.max_waiting)
      return Refusal{SubmitError::queue_full,
                     fmt::format("{} requests are already waiting (--max-queue {})", not_running_.load(),
                                 options_.max_waiting)};
    stream = std::make_shared<RequestStream>(next_id_++, std::move(signal));
    submitted_.emplace_back(std::move(request), stream);
    ++not_running_;
  }
  wake_.notify_one();
  return stream;
}

void AsyncEngine::abort(uint64_t id) {
  {
    std::lock_guard lock(mu_);
    aborted_.push_back(id);
  }
  wake_.notify_one();
}

void AsyncEngine::shutdown(bool drain) {
  {
    std::lock_guard lock(mu_);
    accepting_ = false;
    drain_ = drain;
    stop_ = true;
  }
  wake_.notify_one();
  if (thread_.joinable() && std::this_thread::get_id() != thread_.get_id()) thread_.join();
}

EngineSnapshot AsyncEngine::snapshot() const {
  std::lock_guard lock(mu_);
  return snapshot_;
}

void AsyncEngine::publish_snapshot() {
  const Scheduler& s = engine_->scheduler();
  EngineSnapshot snap;
  snap.running = s.num_running();
  snap.kv_blocks_used = s.block_pool().num_used();
  snap.kv_blocks_total = s.block_pool().num_blocks();
  snap.block_size = s.config().block_size;
  snap.prefix_block_lookups = s.block_pool().counters().lookups;
  snap.prefix_block_hits = s.block_pool().counters().hits;
  snap.prompt_tokens_computed = engine_->stats().prompt_tokens_computed;
  snap.generated_tokens = engine_->stats().generated_tokens;
  snap.preemptions = s.num_preemptions();
  snap.steps = engine_->stats().steps;
  snap.spec_steps = engine_->stats().spec_steps;
  snap.draft_tokens = engine_->stats().draft_tokens;
  snap.accepted_tokens = engine_->stats().accepted_tokens;
  std::lock_guard lock(mu_);
  snap.waiting = s.num_waiting() + static_cast<int64_t>(submitted_.size());
  not_running_ = snap.waiting;
  snapshot_ = snap;
}

void AsyncEngine::loop() {
  for (;;) {
    std::vector<std::pair<GenerateRequest, std::shared_ptr<RequestStream>>> submitted;
    std::vector<uint64_t> aborted;
    bool stopping, drain;
    {
      std::unique_lock lock(mu_);
      wake_.wait(lock, [&] { return stop_ || !submitted_.empty() || !aborted_.empty() || engine_->has_work(); });
      submitted.swap(submitted_);
      aborted.swap(aborted_);
      stopping = stop_;
      drain = drain_;
    }
    for (auto& [request, stream] : submitted) {
      // validate() passed on the caller's thread; only an internal error can refuse it here
      auto id = engine_->add_request(std::move(request), stream->id());
      if (!id) {
        RequestOutput out;
        out.id = stream->id();
        out.finished = true;
        out.finish_reason = FinishReason::abort;
        out.text = id.error().message;
        stream->push(std::move(out));
        continue;
      }
      streams_.emplace(stream->id(), stream);
    }
    for (uint64_t id : aborted) engine_->abort(id);
    if (stopping && !drain)
      for (auto& [id, stream] : streams_) engine_->abort(id);
    if (engine_->has_work()) {
      for (RequestOutput& out : engine_->step()) {
        auto it = streams_.find(out.id);
        if (it == streams_.end()) continue;
        const bool finished = out.finished;
        it->second->push(std::move(out));
        if (finished) streams_.erase(it);
      }
    }
    publish_snapshot();
    if (stopping && !engine_->has_work() && streams_.empty()) {
      std::lock_guard lock(mu_);
      if (submitted_.empty()) return;
    }
  }
}

}  // namespace moat
