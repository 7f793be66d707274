#!/usr/bin/env python3
"""Package pd_router_filter.wasm as a Wasm OCI image and push it to a registry.

Python 3 standard library only: no Docker daemon, no crane/oras, nothing to install.

The image follows the "compat" variant of the Wasm OCI image spec (the one Istio's
`WasmPlugin` with `url: oci://...` pulls, and the one `docker build` of
`FROM scratch` + `COPY plugin.wasm ./` produces):

  manifest  application/vnd.oci.image.manifest.v1+json
  config    application/vnd.oci.image.config.v1+json   (os wasip1, architecture wasm by default)
  layer     application/vnd.oci.image.layer.v1.tar+gzip, one regular file `plugin.wasm`

Istio's fetcher gunzips each layer of such an image and takes the tar entry whose base name
is `plugin.wasm`, so the layer must be gzip-compressed.

Output is deterministic: tar entry mtime 0, uid/gid 0, empty owner names, mode 0644, gzip
header mtime 0 and no file name, sorted JSON keys, fixed `created`. The manifest digest changes
only when the wasm bytes change.

Usage:
  oci.py build --wasm FILE --out DIR [--tag TAG] [--platform OS/ARCH]
                                                        write an OCI image layout directory
  oci.py push  --layout DIR --ref HOST:PORT/REPO[:TAG]  push it over the distribution API
  oci.py pull  --ref HOST:PORT/REPO[:TAG] --out FILE    fetch, verify digests, write plugin.wasm
Registries are spoken to over plain HTTP unless --https is given.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request

MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"
INDEX_TYPE = "application/vnd.oci.image.index.v1+json"
CONFIG_TYPE = "application/vnd.oci.image.config.v1+json"
LAYER_TYPE = "application/vnd.oci.image.layer.v1.tar+gzip"
# Docker schema 2 types, accepted on pull so an image pushed by other tools still verifies.
DOCKER_MANIFEST_TYPE = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LAYER_TYPE = "application/vnd.docker.image.rootfs.diff.tar.gzip"
PLUGIN_FILE = "plugin.wasm"
EPOCH = "1970-01-01T00:00:00Z"
# Istio ignores the platform. Kubernetes image volumes go through the container runtime, which
# may insist on the node's platform; build with --platform linux/amd64 for that use.
DEFAULT_PLATFORM = "wasip1/wasm"


class OciError(Exception):
    pass


def sha256_digest(data):
    return "sha256:" + hashlib.sha256(data).hexdigest()


def canonical_json(value):
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def layer_tar(wasm):
    """Uncompressed tar holding only plugin.wasm, with every variable field fixed."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        info = tarfile.TarInfo(PLUGIN_FILE)
        info.size = len(wasm)
        info.mtime = 0
        info.mode = 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.type = tarfile.REGTYPE
        tar.addfile(info, io.BytesIO(wasm))
    return raw.getvalue()


def gzip_bytes(data):
    out = io.BytesIO()
    # filename="" and mtime=0 keep the gzip header free of the build's path and time.
    with gzip.GzipFile(filename="", mode="wb", fileobj=out, compresslevel=9, mtime=0) as gz:
        gz.write(data)
    return out.getvalue()


def image_blobs(wasm, platform=DEFAULT_PLATFORM):
    """(config, layer, manifest) bytes for one wasm module; platform is "os/architecture"."""
    os_name, _, arch = platform.partition("/")
    if not os_name or not arch:
        raise OciError(f"platform {platform!r} must be OS/ARCH, e.g. wasip1/wasm or linux/amd64")
    tar = layer_tar(wasm)
    layer = gzip_bytes(tar)
    config = canonical_json(
        {
            "architecture": arch,
            "os": os_name,
            "created": EPOCH,
            "config": {},
            "rootfs": {"type": "layers", "diff_ids": [sha256_digest(tar)]},
            "history": [{"created": EPOCH, "created_by": "pd-router envoy/oci/oci.py"}],
        }
    )
    manifest = canonical_json(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_TYPE,
            "config": {"mediaType": CONFIG_TYPE, "digest": sha256_digest(config), "size": len(config)},
            "layers": [
                {
                    "mediaType": LAYER_TYPE,
                    "digest": sha256_digest(layer),
                    "size": len(layer),
                    # No `org.opencontainers.image.title`: oras would save the gzipped tar
                    # under that name, as if it were the module itself.
                }
            ],
        }
    )
    return config, layer, manifest


def write_blob(out, data):
    digest = sha256_digest(data)
    path = os.path.join(out, "blobs", "sha256", digest.split(":", 1)[1])
    with open(path, "wb") as f:
        f.write(data)
    return digest


def build(wasm_path, out, tag, platform=DEFAULT_PLATFORM):
    with open(wasm_path, "rb") as f:
        wasm = f.read()
    if wasm[:4] != b"\0asm":
        raise OciError(f"{wasm_path} is not a wasm module (no \\0asm magic)")
    config, layer, manifest = image_blobs(wasm, platform)
    # Start from an empty directory so blobs of an older build never linger.
    if os.path.isdir(out):
        shutil.rmtree(out)
    os.makedirs(os.path.join(out, "blobs", "sha256"))
    for blob in (config, layer, manifest):
        write_blob(out, blob)
    with open(os.path.join(out, "oci-layout"), "wb") as f:
        f.write(canonical_json({"imageLayoutVersion": "1.0.0"}))
    index = {
        "schemaVersion": 2,
        "mediaType": INDEX_TYPE,
        "manifests": [
            {
                "mediaType": MANIFEST_TYPE,
                "digest": sha256_digest(manifest),
                "size": len(manifest),
                "annotations": {"org.opencontainers.image.ref.name": tag},
            }
        ],
    }
    with open(os.path.join(out, "index.json"), "wb") as f:
        f.write(canonical_json(index))
    return sha256_digest(manifest)


def read_layout(layout):
    """Manifest bytes and its blobs (digest -> bytes) from a layout written by build()."""
    with open(os.path.join(layout, "index.json"), "rb") as f:
        index = json.load(f)
    if len(index.get("manifests", [])) != 1:
        raise OciError(f"{layout}/index.json must list exactly one manifest")

    def blob(digest):
        algo, hexdigest = digest.split(":", 1)
        with open(os.path.join(layout, "blobs", algo, hexdigest), "rb") as f:
            data = f.read()
        if sha256_digest(data) != digest:
            raise OciError(f"blob {digest} in {layout} does not match its digest")
        return data

    manifest = blob(index["manifests"][0]["digest"])
    parsed = json.loads(manifest)
    blobs = {}
    for desc in [parsed["config"]] + parsed["layers"]:
        blobs[desc["digest"]] = blob(desc["digest"])
    return manifest, blobs


def parse_ref(ref):
    """HOST[:PORT]/REPO[/...][:TAG] -> (host, repo, tag)."""
    if "://" in ref:
        ref = ref.split("://", 1)[1]
    host, _, rest = ref.partition("/")
    if not rest:
        raise OciError(f"reference {ref!r} needs HOST:PORT/REPO[:TAG]")
    repo, tag = rest, "latest"
    if "@" in rest:
        repo, tag = rest.split("@", 1)
    elif ":" in rest.rsplit("/", 1)[-1]:
        repo, tag = rest.rsplit(":", 1)
    return host, repo, tag


class Registry:
    def __init__(self, host, repo, https=False, timeout=30):
        self.base = f"{'https' if https else 'http'}://{host}"
        self.repo = repo
        self.timeout = timeout

    def request(self, method, path_or_url, data=None, headers=None, ok=(200,)):
        url = urllib.parse.urljoin(self.base, path_or_url)
        req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                body = resp.read()
                status, resp_headers = resp.status, resp.headers
        except urllib.error.HTTPError as err:
            body = err.read()
            status, resp_headers = err.code, err.headers
        if status not in ok:
            raise OciError(f"{method} {url}: HTTP {status}: {body[:500].decode(errors='replace')}")
        return status, resp_headers, body

    def has_blob(self, digest):
        status, _, _ = self.request("HEAD", f"/v2/{self.repo}/blobs/{digest}", ok=(200, 404))
        return status == 200

    def put_blob(self, digest, data):
        """Monolithic upload: POST opens a session, PUT ?digest= closes it with the bytes."""
        _, headers, _ = self.request("POST", f"/v2/{self.repo}/blobs/uploads/", data=b"", ok=(202,))
        location = headers.get("Location")
        if not location:
            raise OciError("registry gave no Location for the upload session")
        sep = "&" if "?" in location else "?"
        url = f"{location}{sep}digest={urllib.parse.quote(digest)}"
        _, headers, _ = self.request(
            "PUT",
            url,
            data=data,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(data))},
            ok=(201,),
        )
        got = headers.get("Docker-Content-Digest")
        if got and got != digest:
            raise OciError(f"registry stored blob as {got}, expected {digest}")

    def put_manifest(self, tag, manifest, media_type):
        _, headers, _ = self.request(
            "PUT",
            f"/v2/{self.repo}/manifests/{tag}",
            data=manifest,
            headers={"Content-Type": media_type},
            ok=(201,),
        )
        got = headers.get("Docker-Content-Digest")
        if got and got != sha256_digest(manifest):
            raise OciError(f"registry stored manifest as {got}, expected {sha256_digest(manifest)}")

    def get_manifest(self, ref):
        accept = ", ".join([MANIFEST_TYPE, DOCKER_MANIFEST_TYPE])
        _, headers, body = self.request(
            "GET", f"/v2/{self.repo}/manifests/{ref}", headers={"Accept": accept}
        )
        return headers, body

    def get_blob(self, digest):
        _, _, body = self.request("GET", f"/v2/{self.repo}/blobs/{digest}")
        if sha256_digest(body) != digest:
            raise OciError(f"blob {digest} from the registry does not match its digest")
        return body


def push(layout, ref, https=False):
    host, repo, tag = parse_ref(ref)
    manifest, blobs = read_layout(layout)
    reg = Registry(host, repo, https)
    uploaded = 0
    for digest, data in blobs.items():
        if reg.has_blob(digest):
            continue
        reg.put_blob(digest, data)
        uploaded += 1
    reg.put_manifest(tag, manifest, MANIFEST_TYPE)
    return sha256_digest(manifest), uploaded


def extract_plugin(layer, media_type):
    data = gzip.decompress(layer) if media_type.endswith("gzip") else layer
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        for member in tar:
            if member.isfile() and os.path.basename(member.name) == PLUGIN_FILE:
                return tar.extractfile(member).read()
    raise OciError(f"no {PLUGIN_FILE} in the layer")


def pull(ref, https=False):
    """(manifest digest, plugin.wasm bytes) with every digest checked."""
    host, repo, tag = parse_ref(ref)
    reg = Registry(host, repo, https)
    headers, manifest = reg.get_manifest(tag)
    digest = sha256_digest(manifest)
    served = headers.get("Docker-Content-Digest")
    if served and served != digest:
        raise OciError(f"manifest digest header {served} != sha256 of the body {digest}")
    if tag.startswith("sha256:") and tag != digest:
        raise OciError(f"manifest {digest} does not match the requested {tag}")
    parsed = json.loads(manifest)
    reg.get_blob(parsed["config"]["digest"])
    for layer in parsed["layers"]:
        if layer["mediaType"] not in (LAYER_TYPE, DOCKER_LAYER_TYPE):
            continue
        data = reg.get_blob(layer["digest"])
        if len(data) != layer["size"]:
            raise OciError(f"layer {layer['digest']} has {len(data)} bytes, manifest says {layer['size']}")
        try:
            return digest, extract_plugin(data, layer["mediaType"])
        except OciError:
            continue
    raise OciError(f"no layer of {ref} holds {PLUGIN_FILE}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write an OCI image layout")
    b.add_argument("--wasm", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--tag", default="latest")
    b.add_argument("--platform", default=DEFAULT_PLATFORM, help="OS/ARCH of the image config")
    p = sub.add_parser("push", help="push a layout to a registry")
    p.add_argument("--layout", required=True)
    p.add_argument("--ref", required=True, help="HOST:PORT/REPO[:TAG]")
    p.add_argument("--https", action="store_true")
    g = sub.add_parser("pull", help="pull plugin.wasm back, verifying digests")
    g.add_argument("--ref", required=True)
    g.add_argument("--out", required=True)
    g.add_argument("--https", action="store_true")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "build":
            digest = build(args.wasm, args.out, args.tag, args.platform)
            print(f"oci: {args.out} manifest {digest}")
        elif args.cmd == "push":
            digest, uploaded = push(args.layout, args.ref, args.https)
            print(f"oci: pushed {args.ref} manifest {digest} ({uploaded} blob(s) uploaded)")
        else:
            digest, wasm = pull(args.ref, args.https)
            with open(args.out, "wb") as f:
                f.write(wasm)
            print(f"oci: pulled {args.ref} manifest {digest} -> {args.out} ({len(wasm)} bytes)")
    except (OciError, OSError, ValueError, KeyError) as err:
        print(f"oci: error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
