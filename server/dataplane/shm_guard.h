// Touching a client's shared memory without letting the client kill the daemon: a mapping of a
// POSIX shm object raises SIGBUS on access past the object's end, and the client may truncate the
// object at any time. These run a copy (or a small function) with SIGBUS caught on this thread; a
// fault ends it early and they report false. Any other SIGBUS keeps its default action (a crash
// with a core), as before. docs/regions.md, "Shared-memory safety".
#ifndef ATTND_SERVER_DATAPLANE_SHM_GUARD_H_
#define ATTND_SERVER_DATAPLANE_SHM_GUARD_H_

#include <cstddef>

namespace attnd {

// Installs the process's SIGBUS handler (idempotent, thread-safe). The functions below call it.
void InstallShmGuard();

// memcpy(dst, src, n); false if a SIGBUS from either side interrupted it (dst may be partly
// written).
bool GuardedCopy(void* dst, const void* src, size_t n);

// Runs fn(arg); false if a SIGBUS interrupted it. fn must own nothing that needs a destructor or
// an unlock when it is abandoned half-way (it is left by siglongjmp): plain loads, stores, atomics,
// memcpy.
bool RunGuarded(void (*fn)(void*), void* arg);

}  // namespace attnd

#endif  // ATTND_SERVER_DATAPLANE_SHM_GUARD_H_
