"""A client for a fleet of attnd daemons (docs/fleet.md): placement at create_sequence, routing by the id's owner.

Every daemon of a fleet runs with its own --instance-name, and its sequence ids are "<instance>.<32 hex>". The
FleetClient asks each endpoint who it is (GetServerInfo), places a new sequence on the daemon with the most free KV
pages (round robin among ties, and when tokens hide pages_free), and sends every later call for a sequence to the
daemon its id names.
"""
import concurrent.futures
import socket
import threading

import grpc

from ._client import Client
from ._errors import AttndError, invalid_argument

_DNS = "dns:///"


def _split_host_port(target):
    if target.startswith("["):
        close = target.find("]")
        if close < 0 or target[close + 1:close + 2] != ":":
            return None
        host, port = target[1:close], target[close + 2:]
    else:
        host, _, port = target.rpartition(":")
    if not host or not port:
        return None
    return host, port


def resolve(targets):
    """The endpoints `targets` stand for: "host:port" as is, "dns:///host:port" as every address it resolves to
    (sorted), in order, without duplicates. Raises AttndError: INVALID_ARGUMENT for an empty list or a malformed
    target, UNAVAILABLE for a name that does not resolve."""
    if isinstance(targets, str):
        targets = [targets]
    targets = list(targets)
    if not targets:
        raise invalid_argument("a fleet needs at least one target")
    out = []
    for t in targets:
        if t.startswith(_DNS):
            hp = _split_host_port(t[len(_DNS):])
            if hp is None:
                raise invalid_argument("fleet target %r must be dns:///host:port" % t)
            try:
                infos = socket.getaddrinfo(hp[0], hp[1], type=socket.SOCK_STREAM)
            except socket.gaierror as err:
                raise AttndError(grpc.StatusCode.UNAVAILABLE, "cannot resolve %s: %s" % (t, err)) from None
            these = set()
            for family, _, _, _, addr in infos:
                if family == socket.AF_INET:
                    these.add("%s:%d" % (addr[0], addr[1]))
                elif family == socket.AF_INET6:
                    these.add("[%s]:%d" % (addr[0], addr[1]))
            these = sorted(these)  # getaddrinfo's order varies; placement's tie-breaking should not
            if not these:
                raise AttndError(grpc.StatusCode.UNAVAILABLE, "%s resolves to no IPv4 or IPv6 address" % t)
        else:
            if _split_host_port(t) is None:
                raise invalid_argument("fleet target %r must be host:port or dns:///host:port" % t)
            these = [t]
        for e in these:
            if e not in out:
                out.append(e)
    return out


def owner_of(seq):
    """The instance that owns sequence id `seq` (its "<instance>." prefix). Raises AttndError INVALID_ARGUMENT for
    an id without one."""
    if not isinstance(seq, str):
        raise invalid_argument("sequence id must be a str, got %s" % type(seq).__name__)
    dot = seq.find(".")
    if dot <= 0:
        raise invalid_argument("sequence_id %r names no attnd instance (\"<instance>.<32 hex>\"); a fleet client "
                               "routes only ids of daemons started with --instance-name" % seq[:100])
    return seq[:dot]


def _unreachable(err):
    return err.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def _misrouted(err):
    return err.code == grpc.StatusCode.FAILED_PRECONDITION and "is owned by attnd instance" in err.message


def _take(x, idx):
    """Rows idx of a batch: a list, a numpy array or a torch tensor."""
    if isinstance(x, (list, tuple)):
        return [x[i] for i in idx]
    return x[list(idx)]


def _concat(parts):
    first = parts[0]
    if hasattr(first, "new_empty"):  # torch
        import torch
        return torch.cat(parts)
    import numpy as np
    return np.concatenate(parts)


class _Endpoint:
    def __init__(self, target):
        self.target = target
        self.client = None  # a Client; None until used, and after the daemon became unreachable
        self.instance = ""  # its --instance-name, once it answered GetServerInfo
        self.last_error = None


class FleetClient:
    """Many attnd daemons as one client (docs/fleet.md).

    Args:
      targets: a list of "host:port" and/or "dns:///host:port" (every address the name resolves to is an
        endpoint), or one such string.
      placement: "least_loaded" (the daemon with the most kv_cache.pages_free; round robin among ties and when
        tokens hide pages_free) or "round_robin".
      connect_timeout: seconds each GetServerInfo that asks an endpoint who it is, and the CreateSequence of a
        placement, may take (a hung daemon is skipped after it).
      The rest as Client (token, TLS, timeout, options), for every endpoint.

    create_sequence() places a sequence and returns its id, which names its daemon; prefill, decode and release
    go to that daemon. decode() over sequences of several daemons sends one Decode per daemon, concurrently: all
    or nothing holds per daemon only. A daemon that is down makes its sequences' calls raise UNAVAILABLE naming
    the instance; once it is back its sequences are gone (NOT_FOUND): create and prefill them again. Regions,
    rings and Sessions are per daemon: use client_for(seq). Thread safe.
    Raises AttndError at construction only when no endpoint answers (UNAVAILABLE), or one that answers has no
    --instance-name (FAILED_PRECONDITION).
    """

    def __init__(self, targets, token=None, root_cert=None, *, timeout=None, options=(), client_cert=None,
                 client_key=None, placement="least_loaded", connect_timeout=5.0):
        if placement not in ("least_loaded", "round_robin"):
            raise invalid_argument("placement must be 'least_loaded' or 'round_robin', got %r" % (placement,))
        self._targets = [targets] if isinstance(targets, str) else list(targets)
        # Each endpoint's channel gets its own subchannel: gRPC shares them between channels to one address by
        # default, and a fresh channel to a daemon that was down would then wait out the shared one's reconnect
        # backoff (seconds) instead of connecting at once.
        options = (("grpc.use_local_subchannel_pool", 1),) + tuple(options or ())
        self._client_args = dict(token=token, root_cert=root_cert, timeout=timeout, options=options,
                                 client_cert=client_cert, client_key=client_key)
        self._placement = placement
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._endpoints = []
        self._next = 0
        # Two pools: a decode's per-daemon calls may refresh (and wait for probes) from inside the decode pool.
        self._probes = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="attnd-fleet-probe")
        self._calls = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="attnd-fleet-call")
        try:
            try:
                self.refresh()
                failed = None
            except AttndError as err:
                failed = err
            for e in self._endpoints:  # an unnamed daemon is the clearer error, even if nothing else answered
                if e.last_error is not None and e.last_error.code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise e.last_error
            if failed is not None:
                raise failed
        except BaseException:
            self.close()
            raise

    # -- lifecycle --
    def close(self):
        with self._lock:
            clients = [e.client for e in self._endpoints if e.client is not None]
            for e in self._endpoints:
                e.client = None
        for c in clients:
            c.close()
        self._probes.shutdown(wait=False)
        self._calls.shutdown(wait=False)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- endpoints --
    def endpoints(self):
        """[(target, instance, connected)] as the client knows them (no RPC)."""
        with self._lock:
            return [(e.target, e.instance, e.client is not None) for e in self._endpoints]

    def refresh(self):
        """Resolves the targets again and asks every endpoint who it is; raises AttndError UNAVAILABLE if none
        answers."""
        self._reresolve()
        return self._ask_all()

    def _named(self):
        return any(t.startswith(_DNS) for t in self._targets)

    def _reresolve(self):
        """Endpoints still resolved keep their channel and name; new ones are added, vanished ones dropped."""
        resolved = resolve(self._targets)
        with self._lock:
            old = {e.target: e for e in self._endpoints}
            self._endpoints = [old.get(t) or _Endpoint(t) for t in resolved]

    def _connected(self, e):
        with self._lock:
            if e.client is None:
                e.client = Client(e.target, **self._client_args)  # gRPC connects lazily: no wait here
            return e.client

    def _failed(self, e, client, err):
        """An unreachable daemon gets a fresh channel next time (the old one would wait out gRPC's reconnect
        backoff after a restart), and the error names the instance."""
        if not _unreachable(err):
            return err
        with self._lock:
            e.last_error = err
            # A hung daemon (DEADLINE_EXCEEDED) keeps its channel: a new one would wait for a handshake too.
            if e.client is client and err.code == grpc.StatusCode.UNAVAILABLE:
                e.client = None
            instance = e.instance or "?"
        # Not closed here: other threads may still be in calls on it (they fail as this one did).
        return AttndError(err.code, 'attnd instance "%s" at %s is unavailable: %s' % (instance, e.target,
                                                                                     err.message))

    def _ask(self, e):
        client = self._connected(e)
        try:
            info = client.info(timeout=self._connect_timeout)
        except AttndError as err:
            raise self._failed(e, client, err) from None
        with self._lock:
            if not info.instance.name:
                e.last_error = AttndError(grpc.StatusCode.FAILED_PRECONDITION,
                                          "attnd at %s has no --instance-name: in a fleet every daemon needs one, "
                                          "so that a sequence id says which daemon holds it" % e.target)
                raise e.last_error
            e.instance = info.instance.name
            e.last_error = None
            # The newest answer wins: a daemon that came back at another address (a rescheduled pod) is no
            # longer the instance at its old one.
            for other in self._endpoints:
                if other is not e and other.instance == e.instance:
                    other.instance = ""
        return info

    def _ask_all(self):
        """[(endpoint, GetServerInfoResponse)] of every endpoint that answers, concurrently."""
        with self._lock:
            endpoints = list(self._endpoints)
        futures = [self._probes.submit(self._ask, e) for e in endpoints]
        answered, why = [], []
        for e, f in zip(endpoints, futures):
            try:
                answered.append((e, f.result()))
            except AttndError as err:
                why.append("%s: %s" % (e.target, err.message))
        if not answered:
            raise AttndError(grpc.StatusCode.UNAVAILABLE, "no attnd of the fleet is reachable (%s)" % "; ".join(why))
        return answered

    def _find(self, instance):
        for attempt in range(2):
            with self._lock:
                for e in self._endpoints:
                    if e.instance == instance:
                        return e
            if attempt == 0:
                try:
                    self.refresh()  # an instance not seen yet: ask everyone who they are
                except AttndError:
                    pass
        with self._lock:
            known = ", ".join("%s (%s)" % (e.target, e.instance or "?") for e in self._endpoints)
        raise AttndError(grpc.StatusCode.UNAVAILABLE,
                         'attnd instance "%s" is not among this fleet\'s endpoints (%s): it is down or gone; its '
                         'sequences are lost once it restarts' % (instance, known))

    def _on_owner(self, seq, call):
        instance = owner_of(seq)
        for attempt in range(2):
            e = self._find(instance)
            client = self._connected(e)
            try:
                return call(client)
            except AttndError as err:
                if attempt == 0 and _misrouted(err):  # the daemon there is not who it was
                    with self._lock:
                        e.instance = ""
                    try:
                        self.refresh()
                    except AttndError:
                        pass
                    continue
                failed = self._failed(e, client, err)
                if attempt == 0 and _unreachable(err) and self._moved_away(instance, e):
                    continue  # a DNS name now resolves to the instance's new address
                raise failed from None

    def _moved_away(self, instance, e):
        """After `e`, the endpoint of `instance`, could not be reached: whether a refresh finds the instance at
        another endpoint. Only DNS names can start pointing elsewhere, so only they are resolved again."""
        if not self._named():
            return False
        try:
            self.refresh()
        except AttndError:
            return False
        with self._lock:
            for other in self._endpoints:
                if other.instance == instance:
                    return other is not e
        return False

    def client_for(self, seq):
        """The Client of the daemon that owns `seq` (for sessions, regions, info)."""
        return self._connected(self._find(owner_of(seq)))

    # -- calls --
    def create_sequence(self, timeout=None):
        """A new empty sequence on the least loaded reachable daemon (see the class); returns its id."""
        if self._named():  # new pods (scaled up, or back at a new address) take sequences at once
            try:
                self._reresolve()
            except AttndError:
                pass  # a failed lookup keeps the endpoints known so far
        probes = self._ask_all()
        n = len(probes)
        with self._lock:
            start = self._next % n
        order = [(start + i) % n for i in range(n)]
        if self._placement == "least_loaded" and not any(info.tenant_scoped for _, info in probes):
            order.sort(key=lambda i: -probes[i][1].kv_cache.pages_free)  # stable: ties keep their turn
        last = None
        for i in order:
            e = probes[i][0]
            client = self._connected(e)
            try:
                # Bounded like a probe: a daemon that stopped answering since must not hold the placement.
                seq = client.create_sequence(timeout=self._connect_timeout if timeout is None else timeout)
            except AttndError as err:
                last = self._failed(e, client, err)
                if _unreachable(err) or err.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    continue  # full or gone: the next one may take it
                raise last from None
            with self._lock:
                self._next = (i + 1) % n
            return seq
        raise last

    def release(self, seq, timeout=None):
        """Frees a sequence's pages on its daemon; returns how many."""
        return self._on_owner(seq, lambda c: c.release(seq, timeout=timeout))

    def prefill(self, seq, layer, q, k, v, prompt_len=None, timeout=None, return_length=False, q_layout="variants"):
        """Client.prefill on the daemon that owns `seq`."""
        return self._on_owner(seq, lambda c: c.prefill(seq, layer, q, k, v, prompt_len=prompt_len, timeout=timeout,
                                                       return_length=return_length, q_layout=q_layout))

    def decode(self, layer, seqs, q, k, v, timeout=None, return_lengths=False, q_layout="variants"):
        """Client.decode over sequences of any daemons: one Decode per daemon (concurrently), outputs in the order
        of `seqs`. If one daemon's call fails its error is raised (naming the instance) while the other daemons'
        entries were applied."""
        if isinstance(seqs, str):
            seqs = [seqs]
        seqs = list(seqs)
        if not seqs:
            raise invalid_argument("decode needs at least one sequence")
        groups = {}
        for i, s in enumerate(seqs):
            groups.setdefault(owner_of(s), []).append(i)
        if len(groups) == 1:
            return self._on_owner(seqs[0], lambda c: c.decode(layer, seqs, q, k, v, timeout=timeout,
                                                              return_lengths=return_lengths, q_layout=q_layout))
        per_layout = not isinstance(q_layout, (str, int))

        def run(idx):
            part = [seqs[i] for i in idx]
            layouts = _take(q_layout, idx) if per_layout else q_layout
            return self._on_owner(part[0], lambda c: c.decode(layer, part, _take(q, idx), _take(k, idx),
                                                              _take(v, idx), timeout=timeout, return_lengths=True,
                                                              q_layout=layouts))

        owners = list(groups)
        futures = [self._calls.submit(run, groups[o]) for o in owners]
        results, failed, applied = {}, None, []
        for o, f in zip(owners, futures):
            try:
                results[o] = f.result()
                applied.append('"%s"' % o)
            except AttndError as err:
                if failed is None:
                    failed = AttndError(err.code, 'instance "%s": %s' % (o, err.message))
        if failed is not None:
            if applied:
                raise AttndError(failed.code, "%s (the entries of instance%s %s were applied: all or nothing holds "
                                 "per daemon)" % (failed.message, "s" if len(applied) > 1 else "",
                                                  ", ".join(applied)))
            raise failed
        # Concatenated in group order, then put back in the order of seqs.
        flat = [i for o in owners for i in groups[o]]
        out = _concat([results[o][0] for o in owners])
        inverse = [0] * len(seqs)
        for pos, i in enumerate(flat):
            inverse[i] = pos
        out = _take(out, inverse)
        if not return_lengths:
            return out
        lengths = [n for o in owners for n in results[o][1]]
        return out, [lengths[inverse[i]] for i in range(len(seqs))]
