"""A fleet of three attnd daemons on loopback through attnd.FleetClient (docs/fleet.md): least-loaded placement,
routing by the id's owner, outputs equal to one daemon's, FAILED_PRECONDITION from the wrong daemon, one daemon
SIGKILLed (UNAVAILABLE naming it) and restarted under its name (NOT_FOUND, re-created and re-prefilled)."""
import os
import sys
import tempfile
import unittest

import grpc
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import attnd_testing as at  # noqa: E402

attnd = at.attnd
SC = grpc.StatusCode
TINY = os.path.join(at.REPO, "configs", "tiny", "config.json")
H, HKV, D = 4, 2, 64
PAGES = 64
PAGE_BYTES = 32768  # fp32 KV: 2 layers x K,V x 16 tokens x 2 heads x 64 x 4 bytes


def owned_by(seq, owner, this):
    return ('sequence %s is owned by attnd instance "%s" (this is "%s"); send calls for it to that instance'
            % (seq, owner, this))


class Fleet(unittest.TestCase):
    NAMES = ("py-a", "py-b", "py-c")

    @classmethod
    def setUpClass(cls):
        cls.daemons = []
        try:
            for name in cls.NAMES + ("",):  # the last one unnamed: the single daemon outputs are compared with
                extra = ["--instance-name", name] if name else []
                d = at.Daemon(TINY, kv_cache_bytes=PAGES * PAGE_BYTES, extra_args=extra + ["--compute-threads", "1"])
                cls.daemons.append(d)
                d.start()
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        for d in cls.daemons:
            d.stop()

    def setUp(self):
        self.rng = np.random.default_rng(21)
        self.single = attnd.Client(self.daemons[3].target, timeout=60)
        self.clients = [self.single]
        self.fleet = attnd.FleetClient([d.target for d in self.daemons[:3]], timeout=60)

    def tearDown(self):
        self.fleet.close()
        for c in self.clients:
            c.close()

    def tokens(self, t, variants=5):
        r = self.rng
        return (at.random_bf16_exact(r, (t, variants, H, D)), at.random_bf16_exact(r, (t, HKV, D)),
                at.random_bf16_exact(r, (t, HKV, D)))

    def direct(self, i):
        c = attnd.Client(self.daemons[i].target, timeout=60)
        self.clients.append(c)
        return c

    def test_fleet(self):
        self.assertEqual([(t, n) for t, n, _ in self.fleet.endpoints()],
                         [(d.target, n) for d, n in zip(self.daemons, self.NAMES)])
        self.assertEqual(self.direct(0).info().instance.name, "py-a")

        # Least loaded: a prefill of T tokens takes ceil(T/16) of a daemon's 64 pages; equal daemons in turn.
        seqs, refs = [], []
        for t, want in ((48, "py-a"), (32, "py-b"), (16, "py-c"), (20, "py-c")):
            seq = self.fleet.create_sequence()
            self.assertEqual(seq.split(".")[0], want)
            self.assertEqual(len(seq), len(want) + 1 + 32)
            ref = self.single.create_sequence()
            for layer in range(2):
                q, k, v = self.tokens(t)
                got, n = self.fleet.prefill(seq, layer, q, k, v, return_length=True)
                self.assertEqual(n, t)
                np.testing.assert_array_equal(got, self.single.prefill(ref, layer, q, k, v))
            seqs.append(seq)
            refs.append(ref)

        # One decode over all three daemons equals one daemon's batch, in order.
        q, k, v = self.tokens(len(seqs), variants=3)
        got, lengths = self.fleet.decode(1, seqs, q, k, v, return_lengths=True)
        want, want_lengths = self.single.decode(1, refs, q, k, v, return_lengths=True)
        np.testing.assert_array_equal(got, want)
        self.assertEqual(lengths, [49, 33, 17, 21])
        self.assertEqual(lengths, want_lengths)

        # Straight to the wrong daemon: FAILED_PRECONDITION naming the owner.
        b = self.direct(1)
        q, k, v = self.tokens(2)
        with self.assertRaises(attnd.AttndError) as ctx:
            b.prefill(seqs[0], 0, q, k, v)
        self.assertIs(ctx.exception.code, SC.FAILED_PRECONDITION)
        self.assertEqual(ctx.exception.message, owned_by(seqs[0], "py-a", "py-b"))
        q1, k1, v1 = self.tokens(2, variants=3)
        with self.assertRaises(attnd.AttndError) as ctx:
            b.decode(0, [seqs[1], seqs[2]], q1, k1, v1)
        self.assertIs(ctx.exception.code, SC.FAILED_PRECONDITION)
        self.assertEqual(ctx.exception.message, "entries[1]: " + owned_by(seqs[2], "py-c", "py-b"))
        with self.assertRaises(attnd.AttndError) as ctx:
            b.release(seqs[0])
        self.assertIs(ctx.exception.code, SC.FAILED_PRECONDITION)

        # py-b is SIGKILLed: its sequence fails UNAVAILABLE naming it, the others go on, new ones avoid it.
        port_b = int(self.daemons[1].target.rsplit(":", 1)[1])
        self.daemons[1].kill()
        q1, k1, v1 = self.tokens(1, variants=3)
        with self.assertRaises(attnd.AttndError) as ctx:
            self.fleet.decode(1, [seqs[1]], q1, k1, v1)
        self.assertIs(ctx.exception.code, SC.UNAVAILABLE)
        self.assertTrue(ctx.exception.message.startswith(
            'attnd instance "py-b" at %s is unavailable: ' % self.daemons[1].target), ctx.exception.message)
        q2, k2, v2 = self.tokens(3, variants=3)
        with self.assertRaises(attnd.AttndError) as ctx:  # a batch over all three: b's part fails, a's and c's apply
            self.fleet.decode(1, [seqs[0], seqs[1], seqs[2]], q2, k2, v2)
        self.assertIs(ctx.exception.code, SC.UNAVAILABLE)
        self.assertTrue(ctx.exception.message.startswith('instance "py-b": attnd instance "py-b" at '),
                        ctx.exception.message)
        self.assertTrue(ctx.exception.message.endswith(
            '(the entries of instances "py-a", "py-c" were applied: all or nothing holds per daemon)'),
            ctx.exception.message)
        _, lengths = self.fleet.decode(1, [seqs[0], seqs[3]], q1[[0, 0]], k1[[0, 0]], v1[[0, 0]],
                                       return_lengths=True)
        self.assertEqual(lengths, [51, 22])
        placed = {self.fleet.create_sequence().split(".")[0] for _ in range(4)}
        self.assertEqual(placed, {"py-a", "py-c"})

        # Back under its name on its port, empty: the old sequence is NOT_FOUND; re-created (py-b has the most
        # free pages now) and re-prefilled.
        self.daemons[1].start(port=port_b)
        with self.assertRaises(attnd.AttndError) as ctx:
            self.fleet.decode(1, [seqs[1]], q1, k1, v1)
        self.assertIs(ctx.exception.code, SC.NOT_FOUND)
        self.assertEqual(ctx.exception.message, "entries[0]: sequence %s not found" % seqs[1])
        again = self.fleet.create_sequence()
        self.assertEqual(again.split(".")[0], "py-b")
        for layer in range(2):
            q, k, v = self.tokens(32)
            self.assertEqual(self.fleet.prefill(again, layer, q, k, v, return_length=True)[1], 32)
        self.assertEqual(self.fleet.release(again), 2)

    def test_an_instance_back_at_another_address_is_found_there(self):
        x1 = at.Daemon(TINY, kv_cache_bytes=PAGES * PAGE_BYTES, extra_args=["--instance-name", "py-x"])
        x2_port = at.free_port()
        try:
            x1.start()
            with attnd.FleetClient([x1.target, "127.0.0.1:%d" % x2_port]) as fleet:
                lost = fleet.create_sequence()
                x1.kill()
                x1.start(port=x2_port)
                with self.assertRaises(attnd.AttndError) as ctx:
                    fleet.release(lost)
                self.assertIs(ctx.exception.code, SC.UNAVAILABLE)
                fleet.refresh()
                self.assertEqual([n for _, n, _ in fleet.endpoints()], ["", "py-x"])
                with self.assertRaises(attnd.AttndError) as ctx:
                    fleet.release(lost)
                self.assertIs(ctx.exception.code, SC.NOT_FOUND)
                self.assertEqual(fleet.create_sequence().split(".")[0], "py-x")
        finally:
            x1.stop()

    def test_with_tokens_placement_is_round_robin(self):
        # Tokens on: pages_free is hidden from tenants (tenant_scoped), so load cannot steer placement.
        token = "fleet-token-0123456789abcdef"
        fd, path = tempfile.mkstemp(prefix="attnd-fleet-tokens-")
        with os.fdopen(fd, "w") as f:
            f.write("team-a %s\n" % token)
        daemons = [at.Daemon(TINY, kv_cache_bytes=PAGES * PAGE_BYTES, token=token,
                             extra_args=["--instance-name", n, "--auth-token-file", path]) for n in ("py-t0", "py-t1")]
        try:
            for d in daemons:
                d.start()
            with attnd.FleetClient([d.target for d in daemons], token=token) as fleet:
                owners = []
                for _ in range(4):
                    seq = fleet.create_sequence()
                    owners.append(seq.split(".")[0])
                    if owners[-1] == "py-t0":  # load py-t0 only: least loaded would avoid it
                        fleet.prefill(seq, 0, *self.tokens(100))
                self.assertEqual(owners, ["py-t0", "py-t1", "py-t0", "py-t1"])
        finally:
            for d in daemons:
                d.stop()
            os.unlink(path)

    def test_targets(self):
        port = int(self.daemons[0].target.rsplit(":", 1)[1])
        self.assertIn("127.0.0.1:%d" % port, attnd._fleet.resolve(["dns:///localhost:%d" % port]))
        with self.assertRaises(attnd.AttndError) as ctx:
            attnd._fleet.resolve("dns:///localhost")
        self.assertIs(ctx.exception.code, SC.INVALID_ARGUMENT)
        with self.assertRaises(attnd.AttndError) as ctx:
            attnd.FleetClient(["127.0.0.1:%d" % at.free_port()])
        self.assertIs(ctx.exception.code, SC.UNAVAILABLE)
        self.assertTrue(ctx.exception.message.startswith("no attnd of the fleet is reachable ("), ctx.exception)
        with self.assertRaises(attnd.AttndError) as ctx:  # an unnamed daemon cannot be in a fleet
            attnd.FleetClient([self.daemons[0].target, self.daemons[3].target])
        self.assertIs(ctx.exception.code, SC.FAILED_PRECONDITION)
        self.assertEqual(ctx.exception.message,
                         "attnd at %s has no --instance-name: in a fleet every daemon needs one, so that a sequence "
                         "id says which daemon holds it" % self.daemons[3].target)
        with self.assertRaises(attnd.AttndError) as ctx:  # only unnamed: still the clearer error
            attnd.FleetClient([self.daemons[3].target])
        self.assertIs(ctx.exception.code, SC.FAILED_PRECONDITION)
        with self.assertRaises(attnd.AttndError) as ctx:
            self.fleet.prefill("0123456789abcdef0123456789abcdef", 0, *self.tokens(1))
        self.assertIs(ctx.exception.code, SC.INVALID_ARGUMENT)


if __name__ == "__main__":
    unittest.main()
