#include "server/dataplane/shm_guard.h"

#include <setjmp.h>
#include <signal.h>

#include <cstring>
#include <mutex>

namespace attnd {
namespace {

// The guard of the function running on this thread, or null.
thread_local sigjmp_buf* t_guard = nullptr;

void OnSigbus(int sig, siginfo_t* info, void* context) {
  (void)info;
  (void)context;
  sigjmp_buf* guard = t_guard;
  if (guard != nullptr) {
    t_guard = nullptr;
    siglongjmp(*guard, 1);
  }
  // Not ours: the default action, when the faulting instruction runs again.
  signal(sig, SIG_DFL);
}

struct CopyArgs {
  void* dst;
  const void* src;
  size_t n;
};

void Copy(void* arg) {
  auto* a = static_cast<CopyArgs*>(arg);
  std::memcpy(a->dst, a->src, a->n);
}

}  // namespace

void InstallShmGuard() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_sigaction = OnSigbus;
    sa.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGBUS, &sa, nullptr);
  });
}

bool RunGuarded(void (*fn)(void*), void* arg) {
  InstallShmGuard();
  sigjmp_buf guard;
  // savemask 0: SA_NODEFER leaves SIGBUS unblocked in the handler, so there is no mask to restore.
  if (sigsetjmp(guard, 0) != 0) return false;  // t_guard was cleared by the handler
  t_guard = &guard;
  fn(arg);
  t_guard = nullptr;
  return true;
}

bool GuardedCopy(void* dst, const void* src, size_t n) {
  if (n == 0) return true;
  CopyArgs args{dst, src, n};
  return RunGuarded(Copy, &args);
}

}  // namespace attnd
