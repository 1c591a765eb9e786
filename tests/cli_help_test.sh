#!/bin/bash
# attnd and attnctl: -h / --help list the flags of their main.cc (absl's default filter matched no
# file and printed "No flags matched"), --version prints the version, revision and build, and
# attnctl health exits as its usage says.
set -u
attnd=$1
attnctl=$2
fail=0
check() {  # check NAME OUTPUT REGEX...
  local name=$1 out=$2
  shift 2
  for re in "$@"; do
    if ! grep -Eq -- "$re" <<<"$out"; then
      echo "FAIL: $name: no match for /$re/ in:"; echo "$out" | head -20; fail=1
    fi
  done
  if grep -q "No flags matched" <<<"$out"; then echo "FAIL: $name: No flags matched"; fail=1; fi
}
for h in -h --help; do
  check "attnd $h" "$("$attnd" "$h" 2>&1)" "Flags from server/main.cc" "--listen" "--kv_cache_bytes" \
    "--drain_timeout" "--auth_token_file"
  check "attnctl $h" "$("$attnctl" "$h" 2>&1)" "Flags from client/main.cc" "--target" "--token_file" \
    "attnctl <info"
done
for pair in "attnd:$attnd" "attnctl:$attnctl"; do
  name=${pair%%:*} bin=${pair#*:}
  out=$("$bin" --version 2>&1)
  rc=$?
  [ $rc -eq 0 ] || { echo "FAIL: $name --version exited $rc"; fail=1; }
  check "$name --version" "$out" "^$name [0-9]+\.[0-9]+\.[0-9]+$" "^revision: ([0-9a-f]{12}(-dirty)?|unknown)" \
    "^build: (opt|dbg|fastbuild) .*CUDA backend: (yes|no)$"
done
# attnctl health: 1 when not SERVING, the server unreachable included (its usage); 2 for usage errors.
out=$("$attnctl" health --target 127.0.0.1:1 --connect-timeout 20s 2>&1)
rc=$?
[ $rc -eq 1 ] || { echo "FAIL: attnctl health on a closed port exited $rc, want 1: $out"; fail=1; }
check "attnctl health (closed port)" "$out" "cannot reach attnd at 127.0.0.1:1: connection refused"
"$attnctl" frobnicate >/dev/null 2>&1
rc=$?
[ $rc -eq 2 ] || { echo "FAIL: attnctl frobnicate exited $rc, want 2"; fail=1; }
[ $fail -eq 0 ] && echo PASS
exit $fail
