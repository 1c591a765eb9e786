// TESTS AND BENCHMARKS ONLY. Engine jobs (server/engine/engine.h) are made by the runtime alone,
// from requests it validated; engine tests and benchmarks drive an engine directly, so they make
// their jobs here, and must make them valid themselves (the engines check only what their kernels
// could not survive). Production code must never include this header.
#ifndef ATTND_SERVER_ENGINE_ENGINE_JOBS_FOR_TESTING_H_
#define ATTND_SERVER_ENGINE_ENGINE_JOBS_FOR_TESTING_H_

#include "server/engine/engine.h"

namespace attnd {

class EngineJobsForTesting {
 public:
  static PrefillJob Prefill() { return PrefillJob(EngineJobKey()); }
  static DecodeJob Decode() { return DecodeJob(EngineJobKey()); }
};

}  // namespace attnd

#endif  // ATTND_SERVER_ENGINE_ENGINE_JOBS_FOR_TESTING_H_
