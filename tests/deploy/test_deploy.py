"""Static checks of deploy/: the Kubernetes manifests and the Containerfile, against each other,
server/main.cc and script/image (which builds and runs the image for real).

Run from the repository root:
    /usr/bin/python3 -m unittest discover -s tests/deploy -t .
Needs Debian's python3-yaml (installed by script/bootstrap).
"""
import json
import os
import re
import shutil
import subprocess
import unittest

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
K8S = os.path.join(ROOT, "deploy", "k8s")
FLEET = os.path.join(ROOT, "deploy", "k8s-fleet")  # the StatefulSet overlay of K8S (docs/fleet.md)
CONTAINERFILE = os.path.join(ROOT, "deploy", "Containerfile")

# Flags the manifests use that server/main.cc does not define yet: the operations building blocks
# (server/rpc/metrics_http.h, server/rpc/auth.h, server/rpc/tls.h) are ready but not wired. Remove each name
# once main.cc defines it; the test then holds main.cc to it.
PENDING_DAEMON_FLAGS = set()


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def load_docs(name, folder=K8S):
    return [d for d in yaml.safe_load_all(read(os.path.join(folder, name))) if d is not None]


def daemon_flags():
    """Flag names (underscore form) defined with ABSL_FLAG in server/main.cc."""
    text = read(os.path.join(ROOT, "server", "main.cc"))
    return set(re.findall(r"ABSL_FLAG\(\s*[^,]+,\s*(\w+)\s*,", text))


def flag_name(arg):
    m = re.match(r"--([A-Za-z0-9_-]+)(=|$)", arg)
    return m.group(1).replace("-", "_") if m else None


def flag_values(args):
    out = {}
    for a in args:
        name = flag_name(a)
        if name:
            out[name] = a.split("=", 1)[1] if "=" in a else ""
    return out


def seconds(duration):
    """'30s', '10m', '1h30m', '500ms' -> seconds (absl::Duration flag syntax)."""
    total, pos = 0.0, 0
    for m in re.finditer(r"(\d+(?:\.\d+)?)(ms|s|m|h)", duration):
        if m.start() != pos:
            break
        total += float(m.group(1)) * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[m.group(2)]
        pos = m.end()
    if pos != len(duration) or not duration:
        raise ValueError("not a duration: %r" % duration)
    return total


class ManifestsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.files = sorted(f for f in os.listdir(K8S) if f.endswith((".yaml", ".yml")))
        cls.docs = {f: load_docs(f) for f in cls.files}
        cls.kustomization = cls.docs["kustomization.yaml"][0]
        by_kind = {}
        for f in cls.kustomization["resources"]:
            for d in cls.docs[f]:
                by_kind.setdefault(d["kind"], []).append(d)
        cls.by_kind = by_kind
        (cls.deployment,) = by_kind["Deployment"]
        cls.pod = cls.deployment["spec"]["template"]["spec"]
        (cls.container,) = [c for c in cls.pod["containers"] if c["name"] == "attnd"]
        cls.args = flag_values(cls.container["args"])

    def test_every_manifest_is_a_named_kubernetes_object(self):
        self.assertIn("deployment.yaml", self.files)
        for f, docs in self.docs.items():
            self.assertTrue(docs, f + " is empty")
            for d in docs:
                self.assertIn("apiVersion", d, f)
                self.assertIn("kind", d, f)
                if d["kind"] != "Kustomization":
                    self.assertTrue(d["metadata"]["name"], f)

    def test_kustomization_lists_existing_files_but_not_the_example_secret(self):
        resources = self.kustomization["resources"]
        for r in resources:
            self.assertTrue(os.path.exists(os.path.join(K8S, r)), r)
        self.assertNotIn("secret.example.yaml", resources)
        self.assertEqual(set(resources), set(self.files) - {"kustomization.yaml", "secret.example.yaml"})
        self.assertEqual(sorted(self.by_kind), ["ConfigMap", "Deployment", "Service"])

    def test_one_gpu_per_pod(self):
        self.assertEqual(self.container["resources"]["limits"]["nvidia.com/gpu"], 1)
        self.assertEqual(self.args.get("device"), "cuda")

    def test_ports(self):
        ports = {p["name"]: p["containerPort"] for p in self.container["ports"]}
        self.assertEqual(ports, {"grpc": 50051, "health": 50052, "metrics": 9400})
        self.assertEqual(self.args["listen"], "0.0.0.0:50051")
        self.assertEqual(self.args["health_listen"], "0.0.0.0:50052")
        self.assertEqual(self.args["metrics_listen"], "0.0.0.0:9400")

    def test_grpc_probes_reach_a_port_the_kubelet_can_speak_to(self):
        ports = {p["name"]: p["containerPort"] for p in self.container["ports"]}
        tls_on = "tls_cert" in self.args
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            spec = self.container[probe]
            self.assertIn("grpc", spec, probe + " must be a native gRPC probe")
            port = spec["grpc"]["port"]
            self.assertIn(port, ports.values(), probe)
            # The kubelet's gRPC probe has no TLS: with TLS on, probing the API port always fails.
            if tls_on:
                self.assertNotEqual(port, ports["grpc"], probe + " targets the TLS port")
                self.assertEqual(port, ports["health"], probe)

    def test_prometheus_annotations(self):
        ann = self.deployment["spec"]["template"]["metadata"]["annotations"]
        self.assertEqual(ann["prometheus.io/scrape"], "true")
        self.assertEqual(ann["prometheus.io/port"], "9400")
        self.assertEqual(ann["prometheus.io/path"], "/metrics")

    def test_config_and_secrets_are_mounted_where_the_flags_point(self):
        volumes = {v["name"]: v for v in self.pod["volumes"]}
        mounts = {m["name"]: m for m in self.container["volumeMounts"]}

        def mounted_source(path):
            """(volume, key) that provides the file at `path`."""
            for name, m in mounts.items():
                prefix = m["mountPath"].rstrip("/") + "/"
                if path.startswith(prefix):
                    return volumes[name], path[len(prefix):]
            self.fail("nothing mounted at " + path)

        volume, key = mounted_source(self.args["model_config"])
        self.assertEqual(volume["configMap"]["name"], "attnd-model-config")
        (configmap,) = self.by_kind["ConfigMap"]
        self.assertEqual(configmap["metadata"]["name"], "attnd-model-config")
        self.assertIn(key, configmap["data"])
        for flag, secret in (("tls_cert", "attnd-tls"), ("tls_key", "attnd-tls"),
                             ("auth_token_file", "attnd-tokens")):
            volume, key = mounted_source(self.args[flag])
            self.assertEqual(volume["secret"]["secretName"], secret, flag)
            self.assertTrue(mounts[volume["name"]].get("readOnly"), flag)
            self.assertEqual(volume["secret"].get("defaultMode", 0o644) & 0o007, 0, flag + ": world-readable")
            # The example Secret documents the same key.
            example = {d["metadata"]["name"]: d for d in load_docs("secret.example.yaml")}
            self.assertIn(key, example[secret]["stringData"], flag)

    def test_configmap_matches_the_checked_in_model_config(self):
        (configmap,) = self.by_kind["ConfigMap"]
        served = json.loads(configmap["data"]["config.json"])
        with open(os.path.join(ROOT, "configs", "qwen2.5-7b-instruct-1m", "config.json")) as f:
            self.assertEqual(served, json.load(f))
        self.assertIn("dual_chunk_attention_config", served)

    def test_runs_as_non_root(self):
        pod_sc = self.pod["securityContext"]
        self.assertIs(pod_sc["runAsNonRoot"], True)
        self.assertGreater(pod_sc["runAsUser"], 0)
        sc = self.container["securityContext"]
        self.assertIs(sc["allowPrivilegeEscalation"], False)
        self.assertIs(sc["readOnlyRootFilesystem"], True)
        self.assertEqual(sc["capabilities"]["drop"], ["ALL"])

    def test_grace_period_outlasts_pre_stop_and_drain(self):
        drain = seconds(self.args["drain_timeout"])
        pre_stop = 0
        command = self.container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        if command[:1] == ["sleep"]:
            pre_stop = float(command[1])
        self.assertGreater(self.pod["terminationGracePeriodSeconds"], drain + pre_stop)

    def test_service_targets_named_container_ports(self):
        (service,) = self.by_kind["Service"]
        names = {p["name"] for p in self.container["ports"]}
        self.assertEqual(service["spec"]["selector"],
                         self.deployment["spec"]["selector"]["matchLabels"])
        self.assertEqual(self.deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"],
                         service["spec"]["selector"]["app.kubernetes.io/name"])
        by_name = {p["name"]: p for p in service["spec"]["ports"]}
        self.assertEqual(by_name["grpc"]["port"], 50051)
        self.assertEqual(by_name["grpc"].get("appProtocol"), "grpc")
        for p in service["spec"]["ports"]:
            self.assertIn(p["targetPort"], names)
        self.assertNotIn("health", by_name)  # only the kubelet talks to the plaintext health port

    def test_example_secret_holds_placeholders_only(self):
        for d in load_docs("secret.example.yaml"):
            self.assertEqual(d["kind"], "Secret")
            self.assertNotIn("data", d, "base64 data could hide real material")
            for key, value in d["stringData"].items():
                lines = [l for l in value.splitlines() if l.strip() and not l.lstrip().startswith("#")]
                self.assertTrue(lines, key)
                for line in lines:
                    for word in line.split():
                        self.assertTrue(word.startswith("REPLACE-"), "%s: %r is not a placeholder" % (key, word))
                self.assertNotIn("BEGIN", value, key)

    def test_daemon_defines_every_flag_the_manifests_use(self):
        defined = daemon_flags()
        self.assertIn("listen", defined)  # the parser works on main.cc at all
        used = set(self.args)
        used |= set(image_flags(containerfile()))
        unknown = sorted(used - defined - PENDING_DAEMON_FLAGS)
        self.assertEqual(unknown, [], "flags not defined in server/main.cc")
        # A pending flag that main.cc now defines should leave the pending list.
        self.assertEqual(sorted(PENDING_DAEMON_FLAGS & defined), [],
                         "now defined in main.cc: remove from PENDING_DAEMON_FLAGS")


class FleetManifestsTest(unittest.TestCase):
    """deploy/k8s-fleet: the base's pod as a StatefulSet behind a headless Service, each pod named by its pod name."""

    @classmethod
    def setUpClass(cls):
        cls.base = ManifestsTest
        ManifestsTest.setUpClass()
        cls.files = sorted(f for f in os.listdir(FLEET) if f.endswith((".yaml", ".yml")))
        cls.docs = {f: load_docs(f, FLEET) for f in cls.files}
        cls.kustomization = cls.docs["kustomization.yaml"][0]
        by_kind = {}
        for f in cls.kustomization["resources"]:
            if f.endswith(".yaml"):
                for d in cls.docs[f]:
                    by_kind.setdefault(d["kind"], []).append(d)
        cls.by_kind = by_kind
        (cls.sts,) = by_kind["StatefulSet"]
        (cls.headless,) = by_kind["Service"]
        cls.pod = cls.sts["spec"]["template"]["spec"]
        (cls.container,) = [c for c in cls.pod["containers"] if c["name"] == "attnd"]
        cls.args = flag_values(cls.container["args"])

    def test_overlay_of_the_base_replacing_its_deployment_and_service(self):
        resources = self.kustomization["resources"]
        self.assertEqual(resources[0], "../k8s")
        self.assertEqual(os.path.realpath(os.path.join(FLEET, resources[0])), os.path.realpath(K8S))
        patched = set()
        for p in self.kustomization["patches"]:
            (d,) = load_docs(p["path"], FLEET)
            self.assertEqual(d["$patch"], "delete", p["path"])
            patched.add((d["kind"], d["metadata"]["name"]))
        base = {(d["kind"], d["metadata"]["name"]) for k in ("Deployment", "Service") for d in self.base.by_kind[k]}
        self.assertEqual(patched, base)  # exactly the base's single pod and its load-balanced Service
        listed = {r for r in resources if r.endswith(".yaml")} | {p["path"] for p in self.kustomization["patches"]}
        self.assertEqual(listed, set(self.files) - {"kustomization.yaml"})
        self.assertEqual(self.kustomization["images"], self.base.kustomization["images"])
        self.assertEqual(str(self.kustomization["images"][0]["newTag"]), kversion())

    def test_headless_service_names_every_pod(self):
        self.assertEqual(self.headless["spec"]["clusterIP"], "None")
        self.assertEqual(self.sts["spec"]["serviceName"], self.headless["metadata"]["name"])
        self.assertEqual(self.headless["spec"]["selector"], self.sts["spec"]["selector"]["matchLabels"])
        labels = self.sts["spec"]["template"]["metadata"]["labels"]
        for k, v in self.headless["spec"]["selector"].items():
            self.assertEqual(labels[k], v)
        names = {p["name"] for p in self.container["ports"]}
        by_name = {p["name"]: p for p in self.headless["spec"]["ports"]}
        self.assertEqual(by_name["grpc"]["port"], 50051)
        for p in self.headless["spec"]["ports"]:
            self.assertIn(p["targetPort"], names)
        self.assertNotIn("health", by_name)

    def test_each_pod_is_an_instance_named_by_its_pod_name(self):
        self.assertGreaterEqual(self.sts["spec"]["replicas"], 2)
        self.assertEqual(self.sts["spec"]["podManagementPolicy"], "Parallel")
        env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in self.container["env"]}
        self.assertEqual(env, {"POD_NAME": "metadata.name", "POD_NAMESPACE": "metadata.namespace"})
        self.assertEqual(self.args["instance_name"], "$(POD_NAME)")
        grpc_port = port(self.args["listen"])
        self.assertEqual(self.args["advertise_address"], "$(POD_NAME).%s.$(POD_NAMESPACE).svc:%d"
                         % (self.headless["metadata"]["name"], grpc_port))
        # A StatefulSet pod is "<name>-<ordinal>": a DNS label, as --instance-name requires.
        self.assertRegex("%s-%d" % (self.sts["metadata"]["name"], self.sts["spec"]["replicas"] - 1),
                         r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$")
        defined = daemon_flags()
        self.assertEqual(sorted(set(self.args) - defined), [], "flags not defined in server/main.cc")

    def test_pod_template_is_the_base_pod_plus_the_instance_flags(self):
        template = json.loads(json.dumps(self.sts["spec"]["template"]))
        (container,) = [c for c in template["spec"]["containers"] if c["name"] == "attnd"]
        del container["env"]
        container["args"] = [a for a in container["args"]
                             if flag_name(a) not in ("instance_name", "advertise_address")]
        self.assertEqual(template, self.base.deployment["spec"]["template"])
        self.assertEqual(self.sts["spec"]["selector"], self.base.deployment["spec"]["selector"])

    @unittest.skipUnless(shutil.which("kubectl"), "no kubectl to render the overlay with")
    def test_kustomize_renders_the_fleet(self):
        out = subprocess.run(["kubectl", "kustomize", FLEET], check=True, capture_output=True, text=True).stdout
        kinds = sorted((d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out) if d)
        self.assertEqual(kinds, [("ConfigMap", "attnd-model-config"), ("Service", "attnd-headless"),
                                 ("StatefulSet", "attnd")])


def containerfile():
    """The Containerfile as {"args": {ARG: default}, "from": [...], "env": {...}, "instr": [(KEYWORD,
    rest)]}, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(
        l for l in read(CONTAINERFILE).splitlines() if not l.lstrip().startswith("#")))
    out = {"args": {}, "from": [], "env": {}, "instr": []}
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        out["instr"].append((keyword, rest))
        if keyword == "ARG":
            name, _, default = rest.partition("=")
            out["args"].setdefault(name, default)
        elif keyword == "FROM":
            out["from"].append(rest)
        elif keyword == "ENV":
            for m in re.finditer(r"(\w+)=(\S*)", rest):
                out["env"][m.group(1)] = m.group(2)
    return out


def instructions(cf, keyword):
    return [rest for k, rest in cf["instr"] if k == keyword]


def image_flags(cf):
    """Flags the image passes attnd: {flag: value} from its FLAGS_* environment."""
    return {k[len("FLAGS_"):]: v for k, v in cf["env"].items() if k.startswith("FLAGS_")}


def port(address):
    return int(address.rsplit(":", 1)[1])


def kversion():
    m = re.search(r'kVersion\[\] = "([^"]+)"', read(os.path.join(ROOT, "version", "build_info.h")))
    return m.group(1)


class ContainerfileTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.cf = containerfile()
        (cls.entrypoint,) = [json.loads(e) for e in instructions(cls.cf, "ENTRYPOINT")]
        cls.flags = image_flags(cls.cf)
        cls.script = read(os.path.join(ROOT, "script", "image"))
        cls.k8s = ManifestsTest
        ManifestsTest.setUpClass()

    def test_one_stage_on_the_debootstrapped_base(self):
        self.assertEqual(self.cf["from"], ["${BASE}"])
        base = self.cf["args"]["BASE"]
        self.assertEqual(base, "localhost/attnd-debian:bookworm")
        # script/image makes that base and passes it.
        self.assertIn("base=" + base, self.script)
        self.assertIn('--build-arg BASE="$base"', self.script)
        self.assertIn("debootstrap --variant=minbase bookworm", self.script)
        self.assertIn("-f deploy/Containerfile", self.script)
        self.assertIn("--format docker", self.script)  # OCI images drop HEALTHCHECK

    def test_only_runtime_libraries_from_apt(self):
        installs = [r for r in instructions(self.cf, "RUN") if "apt-get install" in r]
        self.assertEqual(len(installs), 1)
        packages = [w for w in installs[0].split("apt-get install", 1)[1].split("&&")[0].split()
                    if not w.startswith("-")]
        self.assertIn("libgrpc++1.51", packages)
        self.assertIn("libprotobuf32", packages)
        for p in packages:
            self.assertNotRegex(p, r"-dev$|^(gcc|g\+\+|clang|bazel|make|cmake)", "build tool in the image")
        self.assertIn("--no-install-recommends", installs[0])
        self.assertIn("rm -rf /var/lib/apt/lists/*", installs[0])

    def test_copies_only_the_staged_binaries_and_configs(self):
        copies = sorted(instructions(self.cf, "COPY"))
        self.assertEqual(copies, ["bin/ /opt/attnd/bin/", "configs/ /opt/attnd/configs/"])
        self.assertIn("bazel build --color=no --curses=no //server:attnd //client:attnctl", self.script)
        self.assertIn('cp -L bazel-bin/server/attnd bazel-bin/client/attnctl "$ctx/bin/"', self.script)
        self.assertTrue(os.path.exists(os.path.join(ROOT, "configs", "tiny", "config.json")))

    def test_runs_as_the_non_root_user_of_the_manifests(self):
        (user,) = instructions(self.cf, "USER")
        uid, gid = (int(x) for x in user.split(":"))
        self.assertGreater(uid, 0)
        useradd = [r for r in instructions(self.cf, "RUN") if "useradd" in r][0]
        self.assertIn("--uid %d" % uid, useradd)
        self.assertIn("--gid %d" % gid, useradd)
        pod_sc = self.k8s.pod["securityContext"]
        self.assertEqual((pod_sc["runAsUser"], pod_sc["runAsGroup"]), (uid, gid))

    def test_entrypoint_reads_flags_from_the_environment(self):
        self.assertEqual(self.entrypoint[0], "attnd")
        (fromenv,) = [a for a in self.entrypoint if a.startswith("--tryfromenv=")]
        names = fromenv.split("=", 1)[1].split(",")
        self.assertEqual(sorted(set(names) - daemon_flags()), [], "not attnd flags")
        self.assertEqual(sorted(set(self.flags) - set(names)), [], "FLAGS_* the entrypoint ignores")
        self.assertEqual(instructions(self.cf, "CMD"), ["[]"])
        # Kubernetes passes args (they override the environment) and keeps the entrypoint.
        self.assertNotIn("command", self.k8s.container)
        self.assertEqual(instructions(self.cf, "STOPSIGNAL"), ["SIGTERM"])

    def test_exposed_ports_are_the_flags_and_the_manifests_ports(self):
        (expose,) = instructions(self.cf, "EXPOSE")
        exposed = {int(p) for p in expose.split()}
        by_flag = {f: port(self.flags[f]) for f in ("listen", "health_listen", "metrics_listen")}
        self.assertEqual(exposed, set(by_flag.values()))
        ports = {p["name"]: p["containerPort"] for p in self.k8s.container["ports"]}
        self.assertEqual(ports, {"grpc": by_flag["listen"], "health": by_flag["health_listen"],
                                 "metrics": by_flag["metrics_listen"]})
        for f, p in by_flag.items():
            self.assertEqual(port(self.k8s.args[f]), p, f)
            self.assertTrue(self.flags[f].startswith("0.0.0.0:"), f + " must be reachable from outside")
        ann = self.k8s.deployment["spec"]["template"]["metadata"]["annotations"]
        self.assertEqual(int(ann["prometheus.io/port"]), by_flag["metrics_listen"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            self.assertEqual(self.k8s.container[probe]["grpc"]["port"], by_flag["health_listen"], probe)

    def test_healthcheck_runs_attnctl_health_on_the_health_port(self):
        (hc,) = instructions(self.cf, "HEALTHCHECK")
        cmd = hc[hc.index("CMD") + 3:].strip()
        self.assertTrue(cmd.startswith("attnctl health "), cmd)
        # Shell form, so the target follows FLAGS_health_listen when it is overridden.
        self.assertIn("--target=127.0.0.1:${FLAGS_health_listen##*:}", cmd)
        # attnctl's connect timeout ends before Docker's --timeout kills it.
        connect = re.search(r"--connect-timeout=(\S+)", cmd).group(1)
        self.assertLess(seconds(connect), seconds(re.search(r"--timeout=(\S+)", hc).group(1)))
        start = re.search(r"--start-period=(\S+)", hc).group(1)
        probe = self.k8s.container["startupProbe"]
        self.assertGreaterEqual(seconds(start), 60)
        self.assertLessEqual(seconds(start), probe["periodSeconds"] * probe["failureThreshold"])

    def test_labels_carry_version_and_revision(self):
        labels = " ".join(instructions(self.cf, "LABEL"))
        self.assertIn('org.opencontainers.image.version="${VERSION}"', labels)
        self.assertIn('org.opencontainers.image.revision="${REVISION}"', labels)
        self.assertIn('--build-arg VERSION="$version"', self.script)
        self.assertIn('--build-arg REVISION="$revision"', self.script)

    def test_manifests_deploy_the_image_script_image_builds(self):
        image = self.k8s.container["image"]
        name, tag = image.rsplit(":", 1)
        self.assertEqual(name, "localhost/attnd")
        self.assertIn('"localhost/attnd:$version"', self.script)
        (entry,) = self.k8s.kustomization["images"]
        self.assertEqual(entry["name"], name)
        self.assertEqual(tag, kversion())
        self.assertEqual(str(entry["newTag"]), kversion())

    def test_drain_fits_the_grace_period(self):
        drain = seconds(self.flags["drain_timeout"])
        self.assertLess(drain, self.k8s.pod["terminationGracePeriodSeconds"])


class HelpersTest(unittest.TestCase):
    def test_seconds(self):
        self.assertEqual(seconds("30s"), 30)
        self.assertEqual(seconds("1h30m"), 5400)
        self.assertEqual(seconds("500ms"), 0.5)
        with self.assertRaises(ValueError):
            seconds("30")
        with self.assertRaises(ValueError):
            seconds("x30s")

    def test_flag_values(self):
        self.assertEqual(flag_values(["--drain-timeout=30s", "--tls_cert=/a", "--x", "pos"]),
                         {"drain_timeout": "30s", "tls_cert": "/a", "x": ""})


if __name__ == "__main__":
    unittest.main()
