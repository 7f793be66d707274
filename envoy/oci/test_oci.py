#!/usr/bin/env python3
"""End-to-end test of envoy/oci/oci.py against a real registry (Debian `docker-registry`).

Starts `docker-registry serve` on 127.0.0.1:<free port> with its own temp storage and config,
pushes the image layout built from the filter, then pulls it back through the distribution API
with independent code (urllib here, not oci.py's client) and checks digests and that the layer's
plugin.wasm is byte-identical to the built wasm.

  PD_WASM=path/to/pd_router_filter.wasm python3 envoy/oci/test_oci.py

Skips (exit 0, reason printed) when no registry binary can be found; `make oci-test` installs it.
"""

import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import unittest
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import oci  # noqa: E402

REGISTRY_BIN = os.environ.get("PD_REGISTRY_BIN") or shutil.which("docker-registry") or "/usr/bin/docker-registry"
WASM = os.environ.get("PD_WASM", "")


def sha(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method, url, headers=None, data=None):
    req = urllib.request.Request(url, method=method, headers=headers or {}, data=data)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


class RegistryTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        if not os.access(REGISTRY_BIN, os.X_OK):
            raise unittest.SkipTest(
                f"no registry binary at {REGISTRY_BIN} (apt-get install docker-registry failed or was not run)"
            )
        if not WASM or not os.path.isfile(WASM):
            raise AssertionError(f"PD_WASM={WASM!r} is not a file; run `make wasm` first")
        with open(WASM, "rb") as f:
            cls.wasm = f.read()
        cls.tmp = tempfile.mkdtemp(prefix="pd-oci-test-")
        cls.port = free_port()
        config = os.path.join(cls.tmp, "config.yml")
        with open(config, "w") as f:
            f.write(
                "version: 0.1\n"
                "log:\n  level: warn\n  accesslog:\n    disabled: true\n"
                "storage:\n"
                f"  filesystem:\n    rootdirectory: {cls.tmp}/storage\n"
                "  delete:\n    enabled: true\n"
                f"http:\n  addr: 127.0.0.1:{cls.port}\n"
            )
        cls.log = open(os.path.join(cls.tmp, "registry.log"), "wb")
        version = subprocess.run([REGISTRY_BIN, "--version"], capture_output=True, text=True)
        print(f"registry: {version.stdout.strip() or version.stderr.strip()} on 127.0.0.1:{cls.port}", file=sys.stderr)
        cls.proc = subprocess.Popen([REGISTRY_BIN, "serve", config], stdout=cls.log, stderr=subprocess.STDOUT)
        cls.base = f"http://127.0.0.1:{cls.port}"
        deadline = time.monotonic() + 20
        while True:
            if cls.proc.poll() is not None:
                raise AssertionError(f"registry exited with {cls.proc.returncode}; log in {cls.tmp}/registry.log")
            try:
                status, _, _ = http("GET", cls.base + "/v2/")
                if status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("registry did not answer /v2/ within 20 s")
            time.sleep(0.1)

    @classmethod
    def tearDownClass(cls):
        proc = getattr(cls, "proc", None)
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            cls.log.close()
        if getattr(cls, "tmp", None):
            shutil.rmtree(cls.tmp, ignore_errors=True)

    def layout(self, name, wasm_path=WASM, tag="test"):
        out = os.path.join(self.tmp, name)
        digest = oci.build(wasm_path, out, tag)
        return out, digest

    def test_layout_is_deterministic_and_well_formed(self):
        a, da = self.layout("det-a")
        time.sleep(1.1)  # a timestamp leaking into any blob would now differ
        b, db = self.layout("det-b")
        self.assertEqual(da, db)
        for root, _, files in os.walk(a):
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), a)
                with open(os.path.join(a, rel), "rb") as fa, open(os.path.join(b, rel), "rb") as fb:
                    self.assertEqual(fa.read(), fb.read(), rel)
        with open(os.path.join(a, "oci-layout")) as f:
            self.assertEqual(json.load(f), {"imageLayoutVersion": "1.0.0"})
        with open(os.path.join(a, "index.json")) as f:
            index = json.load(f)
        self.assertEqual(index["schemaVersion"], 2)
        (desc,) = index["manifests"]
        self.assertEqual(desc["mediaType"], oci.MANIFEST_TYPE)
        self.assertEqual(desc["annotations"]["org.opencontainers.image.ref.name"], "test")
        blobs = os.path.join(a, "blobs", "sha256")
        self.assertEqual(len(os.listdir(blobs)), 3)  # manifest, config, layer; nothing stale
        for name in os.listdir(blobs):
            with open(os.path.join(blobs, name), "rb") as f:
                self.assertEqual(hashlib.sha256(f.read()).hexdigest(), name)

        # A different module gives a different digest.
        other = os.path.join(self.tmp, "other.wasm")
        with open(other, "wb") as f:
            f.write(self.wasm + b"\0")
        _, dother = self.layout("det-other", other)
        self.assertNotEqual(da, dother)

    def test_platform_is_recorded_in_the_config(self):
        out = os.path.join(self.tmp, "linux")
        digest = oci.build(WASM, out, "x", "linux/amd64")
        manifest, blobs = oci.read_layout(out)
        self.assertEqual(oci.sha256_digest(manifest), digest)
        config = json.loads(blobs[json.loads(manifest)["config"]["digest"]])
        self.assertEqual((config["os"], config["architecture"]), ("linux", "amd64"))
        with self.assertRaises(oci.OciError):
            oci.build(WASM, out, "x", "nonsense")

    def test_build_rejects_non_wasm(self):
        bogus = os.path.join(self.tmp, "bogus.wasm")
        with open(bogus, "wb") as f:
            f.write(b"not wasm")
        with self.assertRaises(oci.OciError):
            oci.build(bogus, os.path.join(self.tmp, "bogus"), "x")

    def test_push_then_pull_back_byte_identical(self):
        layout, digest = self.layout("push")
        ref = f"127.0.0.1:{self.port}/pd-router/filter:v1"
        self.assertEqual(oci.main(["push", "--layout", layout, "--ref", ref]), 0)

        # Independent pull, the way Istio's fetcher asks for it.
        url = f"{self.base}/v2/pd-router/filter/manifests/v1"
        status, headers, manifest = http("GET", url, {"Accept": oci.MANIFEST_TYPE})
        self.assertEqual(status, 200)
        self.assertEqual(headers["Content-Type"], oci.MANIFEST_TYPE)
        self.assertEqual(headers["Docker-Content-Digest"], digest)
        self.assertEqual(sha(manifest), digest)
        m = json.loads(manifest)
        self.assertEqual(m["schemaVersion"], 2)
        self.assertEqual(m["mediaType"], oci.MANIFEST_TYPE)
        self.assertEqual(m["config"]["mediaType"], oci.CONFIG_TYPE)
        self.assertEqual(len(m["layers"]), 1)
        layer_desc = m["layers"][0]
        self.assertEqual(layer_desc["mediaType"], oci.LAYER_TYPE)

        status, _, config = http("GET", f"{self.base}/v2/pd-router/filter/blobs/{m['config']['digest']}")
        self.assertEqual(status, 200)
        self.assertEqual(sha(config), m["config"]["digest"])
        self.assertEqual(len(config), m["config"]["size"])
        status, _, layer = http("GET", f"{self.base}/v2/pd-router/filter/blobs/{layer_desc['digest']}")
        self.assertEqual(status, 200)
        self.assertEqual(sha(layer), layer_desc["digest"])
        self.assertEqual(len(layer), layer_desc["size"])

        tar_bytes = gzip.decompress(layer)
        self.assertEqual(json.loads(config)["rootfs"]["diff_ids"], [sha(tar_bytes)])
        with tarfile.open(fileobj=io.BytesIO(tar_bytes), mode="r:") as tar:
            members = tar.getmembers()
            self.assertEqual([t.name for t in members], ["plugin.wasm"])
            self.assertTrue(members[0].isfile())
            self.assertEqual(members[0].mtime, 0)
            self.assertEqual(tar.extractfile(members[0]).read(), self.wasm)

        # By digest too, and through oci.py's own pull.
        status, _, by_digest = http("GET", f"{self.base}/v2/pd-router/filter/manifests/{digest}", {"Accept": oci.MANIFEST_TYPE})
        self.assertEqual((status, by_digest), (200, manifest))
        pulled_digest, pulled = oci.pull(f"127.0.0.1:{self.port}/pd-router/filter@{digest}")
        self.assertEqual((pulled_digest, pulled), (digest, self.wasm))

        # Pushing again uploads nothing (blobs exist) and keeps the digest.
        again, uploaded = oci.push(layout, ref)
        self.assertEqual((again, uploaded), (digest, 0))

    def test_pull_of_missing_tag_fails(self):
        with self.assertRaises(oci.OciError):
            oci.pull(f"127.0.0.1:{self.port}/pd-router/absent:nope")


class RefTest(unittest.TestCase):
    def test_parse_ref(self):
        self.assertEqual(oci.parse_ref("127.0.0.1:5000/a/b:v1"), ("127.0.0.1:5000", "a/b", "v1"))
        self.assertEqual(oci.parse_ref("oci://reg:5000/a"), ("reg:5000", "a", "latest"))
        self.assertEqual(oci.parse_ref("reg/a@sha256:00"), ("reg", "a", "sha256:00"))
        with self.assertRaises(oci.OciError):
            oci.parse_ref("justahost:5000")


if __name__ == "__main__":
    unittest.main(verbosity=2)
