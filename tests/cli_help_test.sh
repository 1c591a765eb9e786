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
# Byte sizes and durations: suffixes and bare seconds reach the options; bad values say what is
# expected.
expect_fail() {  # expect_fail NAME REGEX CMD...
  local name=$1 re=$2
  shift 2
  local out rc
  out=$("$@" 2>&1)
  rc=$?
  [ $rc -ne 0 ] || { echo "FAIL: $name exited 0"; fail=1; }
  grep -Eq -- "$re" <<<"$out" || { echo "FAIL: $name: no /$re/ in: $out"; fail=1; }
}
expect_fail "attnd --kv-cache-bytes=1X" "1X\": expected a byte count: .*Ki, Mi, Gi" "$attnd" --kv-cache-bytes=1X
expect_fail "attnd --drain-timeout=thirty" "expected a duration: a number of seconds" \
  "$attnd" --drain-timeout=thirty
expect_fail "attnd 2Mi/1Mi" "ServerOptions::max_inflight_request_bytes \(1048576\) must be at least ServerOptions::max_message_bytes \(2097152\)" \
  "$attnd" --max-message-bytes=2Mi --max-inflight-request-bytes=1Mi --metrics-listen=
expect_fail "attnd --drain-timeout=-5" "--drain-timeout must be >= 0, got -5s" "$attnd" --drain-timeout=-5
# KV dtypes: fp32 is the cpu backend's (the cuda refusal comes before any GPU check; bf16, int8 and
# fp8 run on both, so their cuda start-up depends on the host: server/engine:engine_factory_test
# covers it), and names outside auto|bf16|fp32|fp8|int8 are refused.
expect_fail "attnd --device cuda --kv-dtype fp32" \
  "EngineOptions::kv_dtype: the cuda backend stores K/V as bf16, int8 or fp8; use auto, bf16, int8 or fp8" \
  "$attnd" --listen 127.0.0.1:0 --device cuda --kv-dtype fp32
expect_fail "attnd --kv-dtype int4" "EngineOptions::kv_dtype must be auto, bf16, fp32, fp8 or int8, got \"int4\"" \
  "$attnd" --listen 127.0.0.1:0 --device cpu --kv-dtype int4
expect_fail "attnctl --max-message-bytes=3Gi" "max_message_bytes must be in \[1, 2\^31\), got 3221225472" \
  "$attnctl" info --max-message-bytes=3Gi
check "attnd --help defaults" "$("$attnd" --help 2>&1)" "default: 512Mi;" "0 = min\\(2Gi, an eighth" "0 = min\\(4Gi, an eighth" "default: 30s;"
[ $fail -eq 0 ] && echo PASS
exit $fail
