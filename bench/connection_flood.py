#!/usr/bin/env python3
# Connection flood against attnd (docs/BENCHMARKS.md, "Connection floods"): N idle TCP connections to
# the API port (from two processes, so the client's own fd limit is no bound) and 100 to the
# health-only port, held, then closed; reports whether GetServerInfo answered meanwhile and how long
# after the close GetServerInfo (attnctl info) and the health-only port (attnctl health) answer.
# With a 5th argument the connections send the HTTP/2 preface and an empty SETTINGS frame first.
# Usage, from the repository root: bench/connection_flood.py ATTND ATTNCTL N [preface]
import multiprocessing as mp
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

attnd, attnctl, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
PREFACE = len(sys.argv) > 4
api, hp = 50161, 50162
log = open(os.path.join(tempfile.gettempdir(), 'attnd-flood-%d.log' % os.getpid()), 'w')
d = subprocess.Popen([attnd, '--model_config=configs/tiny/config.json', '--device=cpu',
                      '--listen=127.0.0.1:%d' % api, '--health_listen=127.0.0.1:%d' % hp,
                      '--metrics_listen=', '--kv_cache_bytes=2097152', '--compute_threads=1'],
                     stdout=log, stderr=subprocess.STDOUT)
def ok(cmd):
    return subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
info = [attnctl, 'info', '--target=127.0.0.1:%d' % api, '--connect_timeout=1s']
health = [attnctl, 'health', '--target=127.0.0.1:%d' % hp, '--connect_timeout=1s']
t = time.time()
while not ok(info):
    if time.time() - t > 60: sys.exit('no start')
    time.sleep(0.2)

def hold(port, count, q, release):
    socks, failed = [], 0
    for _ in range(count):
        try:
            s = socket.create_connection(('127.0.0.1', port), timeout=5); socks.append(s)
            if PREFACE: s.sendall(b'PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00')
        except OSError:
            failed += 1
    q.put((len(socks), failed)); release.wait()
    for s in socks: s.close()
    q.put('closed')

q, release = mp.Queue(), mp.Event()
per = n // 2
procs = [mp.Process(target=hold, args=(api, per, q, release)) for _ in range(2)]
procs.append(mp.Process(target=hold, args=(hp, 100, q, release)))
t0 = time.time()
for p in procs: p.start()
opened = [q.get() for _ in procs]
print('connections opened/failed per client:', opened, 'in %.1fs' % (time.time() - t0))
time.sleep(2)
during = ok(info)
print('GetServerInfo while held:', 'OK' if during else 'FAILED')
release.set()
for _ in procs: q.get()
tc = time.time()
res = {}
while time.time() - tc < 30 and len(res) < 2:
    if 'info' not in res and ok(info): res['info'] = time.time() - tc
    if 'health' not in res and ok(health): res['health'] = time.time() - tc
    time.sleep(0.05)
print('after closing: GetServerInfo OK after', '%.2fs' % res['info'] if 'info' in res else 'never (30s)',
      '; health-only port SERVING after', '%.2fs' % res['health'] if 'health' in res else 'never (30s)')
for p in procs: p.join()
d.kill(); d.wait(); log.close()
print(re.findall(r'.*(?:listener|accept4|NOT_SERVING).*', open(log.name).read())[:4])
