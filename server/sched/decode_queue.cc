#include "server/sched/decode_queue.h"

#include <memory>
#include <utility>

namespace attnd {

absl::Status DirectDecodeQueue::Submit(DecodeCall call, const RequestContext& context, Done done) {
  // std::function needs a copyable callable; the shared_ptr keeps the move-only parts in one place.
  auto state = std::make_shared<std::pair<DecodeCall, Done>>(std::move(call), std::move(done));
  Runtime* runtime = runtime_;
  return work_queue_->Submit(context, [runtime, state](absl::Status admitted) {
    if (!admitted.ok()) {
      state->second(std::move(admitted));
      return;
    }
    absl::StatusOr<DecodeResult> result = runtime->Decode(state->first);
    state->second(std::move(result));
  });
}

}  // namespace attnd
