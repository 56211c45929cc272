"""``trioserve pull`` / ``trioserve models`` against a local stand-in for the Hugging Face Hub
(tests/fakes/hub_server.py, reached through ``HF_ENDPOINT``): progress lines, resume after an
interrupted download, a checksum mismatch refused, offline mode. Each pull runs the CLI in its
own process, as a user would, with its own cache folder; nothing leaves this machine."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from huggingface_hub.constants import DOWNLOAD_CHUNK_SIZE

ROOT = Path(__file__).resolve().parents[2]
REPO = "tester/Tiny-GGUF"
# The library writes what it receives in chunks of DOWNLOAD_CHUNK_SIZE (10 MiB), so a file of
# two and a bit chunks, cut one chunk and a bit in, resumes from exactly one chunk.
SIZE = 2 * DOWNLOAD_CHUNK_SIZE + 12345
CUT = DOWNLOAD_CHUNK_SIZE + 1000


@dataclass
class Hub:
    endpoint: str
    control: Path
    log: Path
    cache: Path
    files: dict[str, bytes]

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
        env.update(HF_ENDPOINT=self.endpoint, HF_HUB_CACHE=str(self.cache),
                   HF_HOME=str(self.cache.parent / "hf-home"), HF_HUB_DISABLE_TELEMETRY="1",
                   HF_HUB_DISABLE_IMPLICIT_TOKEN="1", HF_HUB_DISABLE_XET="1",
                   HF_HUB_ETAG_TIMEOUT="10", HF_HUB_DOWNLOAD_TIMEOUT="10")
        env.update(extra)
        return env

    def pull(self, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "trioserve.cli", *args], cwd=ROOT,
                              env=self.env(**env), capture_output=True, text=True, timeout=60)

    def fault(self, **faults: object) -> None:
        self.control.write_text(json.dumps(faults))

    def requests(self) -> list[dict]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]


@pytest.fixture
def hub(tmp_path: Path) -> Iterator[Hub]:
    files = {
        "Tiny-Q4_K_M.gguf": os.urandom(SIZE),
        "Tiny-Q8_0.gguf": os.urandom(1000),
        "Tiny-F16-00001-of-00002.gguf": os.urandom(700),
        "Tiny-F16-00002-of-00002.gguf": os.urandom(900),
        "README.md": b"# tiny\n",
    }
    sources = {}
    for name, data in files.items():
        (tmp_path / "src").mkdir(exist_ok=True)
        sources[name] = str(tmp_path / "src" / name)
        Path(sources[name]).write_bytes(data)
    config = {"repos": {REPO: sources}, "control": str(tmp_path / "faults.json"),
              "log": str(tmp_path / "requests.jsonl")}
    (tmp_path / "hub.json").write_text(json.dumps(config))
    server = subprocess.Popen([sys.executable, str(ROOT / "tests/fakes/hub_server.py"),
                               str(tmp_path / "hub.json")], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None
        port = int(server.stdout.readline())  # the server's first line; it exits on error
        yield Hub(f"http://127.0.0.1:{port}", tmp_path / "faults.json",
                  tmp_path / "requests.jsonl", tmp_path / "cache", files)
    finally:
        server.kill()
        server.wait(timeout=10)


def file_gets(hub: Hub, name: str) -> list[dict]:
    return [r for r in hub.requests() if r["method"] == "GET" and r["path"].endswith("/" + name)]


def test_a_pull_downloads_the_quantisation_with_progress_lines_into_the_cache(hub):
    done = hub.pull("pull", f"{REPO}:q4_k_m")
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path.read_bytes() == hub.files["Tiny-Q4_K_M.gguf"]
    assert path.is_relative_to(hub.cache / "models--tester--Tiny-GGUF" / "snapshots")
    # not a terminal: lines from start to end, no carriage-return bar
    assert "pull Tiny-Q4_K_M.gguf: 0 B of 20.0 MiB (0%)" in done.stderr
    assert "pull Tiny-Q4_K_M.gguf: 20.0 MiB of 20.0 MiB (100%) done" in done.stderr
    assert "\r" not in done.stderr

    again = hub.pull("pull", f"hf:{REPO}:Q4_K_M")  # cached: same path, no second download
    assert again.returncode == 0 and Path(again.stdout.strip()) == path
    assert len(file_gets(hub, "Tiny-Q4_K_M.gguf")) == 1

    for command in (["models"], ["pull", "--list"]):
        listing = hub.pull(*command)
        assert listing.returncode == 0
        assert REPO in listing.stdout and "Tiny-Q4_K_M.gguf" in listing.stdout
        assert "20.0 MiB" in listing.stdout
        assert f"--model-path hf:{REPO}:Tiny-Q4_K_M.gguf" in listing.stdout


def test_a_split_gguf_pulls_every_part_beside_the_first(hub):
    done = hub.pull("pull", f"{REPO}:F16")
    assert done.returncode == 0, done.stderr
    first = Path(done.stdout.strip())
    assert first.name == "Tiny-F16-00001-of-00002.gguf"
    assert (first.parent / "Tiny-F16-00002-of-00002.gguf").read_bytes() == \
        hub.files["Tiny-F16-00002-of-00002.gguf"]


def test_a_dropped_connection_resumes_with_a_range_request_within_the_pull(hub):
    hub.fault(drop_after=CUT)
    done = hub.pull("pull", f"{REPO}:Q4_K_M")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).read_bytes() == hub.files["Tiny-Q4_K_M.gguf"]
    gets = file_gets(hub, "Tiny-Q4_K_M.gguf")
    assert [g["range"] for g in gets] == [None, f"bytes={DOWNLOAD_CHUNK_SIZE}-"]


def test_an_interrupted_pull_is_resumed_by_the_next_one(hub):
    # The connection drops half way and the library's own retry is refused: the pull fails,
    # keeping what it has written; the next pull asks only for the rest.
    hub.fault(drop_after=CUT, fail_next=1)
    failed = hub.pull("pull", f"{REPO}:Q4_K_M")
    assert failed.returncode == 1
    assert "the Hub refused" in failed.stderr and "503" in failed.stderr
    partials = list(hub.cache.rglob("*.trioserve-partial"))
    assert [p.stat().st_size for p in partials] == [DOWNLOAD_CHUNK_SIZE]

    done = hub.pull("pull", f"{REPO}:Q4_K_M")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).read_bytes() == hub.files["Tiny-Q4_K_M.gguf"]
    assert file_gets(hub, "Tiny-Q4_K_M.gguf")[-1]["range"] == f"bytes={DOWNLOAD_CHUNK_SIZE}-"
    assert "(resuming)" in done.stderr
    assert not list(hub.cache.rglob("*.trioserve-partial"))


def test_a_checksum_mismatch_is_refused_and_nothing_is_kept(hub):
    hub.fault(wrong_etag=True)
    refused = hub.pull("pull", f"{REPO}:Q8_0")
    assert refused.returncode == 1
    assert "Tiny-Q8_0.gguf failed its checksum" in refused.stderr
    assert hashlib.sha256(hub.files["Tiny-Q8_0.gguf"]).hexdigest() in refused.stderr
    assert [p for p in hub.cache.rglob("*") if p.is_file() and "blobs" in p.parts] == []
    assert not list(hub.cache.rglob("Tiny-Q8_0.gguf"))


def test_offline_mode_uses_the_cache_and_fails_clearly_without_it(hub):
    missing = hub.pull("pull", f"{REPO}:Q8_0", HF_HUB_OFFLINE="1")
    assert missing.returncode == 1
    assert "not in the Hugging Face cache" in missing.stderr and "offline" in missing.stderr
    assert f"trioserve pull hf:{REPO}:Q8_0" in missing.stderr
    assert hub.requests() == []

    online = hub.pull("pull", f"{REPO}:Q8_0")
    assert online.returncode == 0, online.stderr
    seen = len(hub.requests())
    offline = hub.pull("pull", f"{REPO}:Q8_0", HF_HUB_OFFLINE="1")
    assert offline.returncode == 0, offline.stderr
    assert offline.stdout == online.stdout
    assert len(hub.requests()) == seen  # nothing asked of the Hub

    unreachable = hub.pull("pull", f"{REPO}:Q8_0", HF_ENDPOINT="http://127.0.0.1:9")
    assert unreachable.returncode == 0, unreachable.stderr
    assert unreachable.stdout == online.stdout
    assert "cannot reach the Hub (http://127.0.0.1:9)" in unreachable.stderr
    assert "using the cached" in unreachable.stderr
    nothing = hub.pull("pull", f"{REPO}:Q4_K_M", HF_ENDPOINT="http://127.0.0.1:9")
    assert nothing.returncode == 1
    assert "cannot reach the Hub" in nothing.stderr and "not in the Hugging Face cache" in nothing.stderr


def test_quantisation_errors_list_the_repo_gguf_files(hub):
    missing = hub.pull("pull", f"{REPO}:IQ1_S")
    assert missing.returncode == 1
    assert "'IQ1_S' matches no file" in missing.stderr and "Tiny-Q8_0.gguf" in missing.stderr
    unknown = hub.pull("pull", "tester/No-Such-Repo:Q4_0")
    assert unknown.returncode == 1 and "hf:tester/No-Such-Repo:Q4_0: the Hub refused" in unknown.stderr


def test_serve_refuses_an_uncached_reference_offline_before_starting(hub):
    refused = hub.pull("serve", "--model-path", f"hf:{REPO}:Q8_0", "--port", "0",
                       HF_HUB_OFFLINE="1")
    assert refused.returncode == 2
    assert "not in the Hugging Face cache" in refused.stderr


def test_the_settings_serve_a_pulled_reference_from_the_cache(hub, monkeypatch):
    """What the worker is given for ``--model-path hf:...`` once the model is pulled (the
    hypercorn entry point and tests read the cache; ``trioserve serve`` pulls first)."""
    from huggingface_hub import constants

    from trioserve.config import Settings
    from trioserve.worker.launch import argv_for

    pulled = hub.pull("pull", f"{REPO}:Q8_0")
    assert pulled.returncode == 0, pulled.stderr
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub.cache))
    settings = Settings(model_path=f"hf:{REPO}:Q8_0", worker_bin="/bin/true")
    argv = argv_for(settings)
    assert argv[argv.index("--model") + 1] == pulled.stdout.strip()
    assert settings.resolved_model_id() == "Tiny-Q8_0"


# --- paths from the network or the command line never leave the cache (issue 47) -------------


def written_outside_the_cache(hub: Hub) -> list[Path]:
    """What a pull wrote outside its cache: files in the test's folder other than the cache and
    the fake Hub's own (its sources, config, control and log files), and what a traversal of
    up to four levels from the cache's folders would have written beside the test's folder."""
    test_dir = hub.control.parent
    own = {hub.control, hub.log, test_dir / "hub.json"}
    stray = [p for p in test_dir.rglob("*") if (p.is_file() or p.is_symlink())
             and not p.is_relative_to(hub.cache) and not p.is_relative_to(test_dir / "src")
             and not p.is_relative_to(test_dir / "hf-home") and p not in own]
    beside = [test_dir.parent / name for name in ("x", "y", "z", "x.trioserve-partial")]
    return stray + [p for p in beside if p.exists() or p.is_symlink()]


def one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("trioserve: "), done.stderr
    return lines[0]


@pytest.mark.parametrize("faults, says", [
    ({"etag": "../../../../x"}, "ETag for Tiny-Q8_0.gguf is not a blob name"),
    ({"etag": "../../blobs2/x"}, "is not a blob name"),
    ({"commit": "../../../../z"}, "is not a 40-digit commit"),
    ({"commit": "0123456789abcdef0123456789abcdef0123456/"}, "is not a 40-digit commit"),
])
def test_a_hub_answering_traversing_etags_or_commits_writes_nothing(hub, faults, says):
    hub.fault(**faults)
    refused = hub.pull("pull", f"{REPO}:Q8_0")
    assert refused.returncode == 1
    assert says in one_line_error(refused)
    assert written_outside_the_cache(hub) == []
    assert [p for p in hub.cache.rglob("*") if p.is_file()] == []
    hub.fault()  # the same Hub, answering honestly: the pull succeeds
    done = hub.pull("pull", f"{REPO}:Q8_0")
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.strip()).read_bytes() == hub.files["Tiny-Q8_0.gguf"]


def test_a_traversing_file_name_in_the_listing_is_refused_before_any_download(hub):
    hub.fault(extra_siblings=["../../../../y-Q5_0.gguf", "ok/../../y-Q6_K.gguf"])
    for selector in ("y-Q5_0.gguf", "Q6_K"):
        refused = hub.pull("pull", f"{REPO}:{selector}")
        assert refused.returncode == 1
        assert "not a path inside the repo" in one_line_error(refused)
    assert not [r for r in hub.requests() if "/resolve/" in r["path"]]  # nothing fetched
    assert written_outside_the_cache(hub) == []
    assert not hub.cache.exists() or [p for p in hub.cache.rglob("*") if p.is_file()] == []
    done = hub.pull("pull", f"{REPO}:Q8_0")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("args", [
    ["--revision", "../../../../y"], ["--revision", "/etc"], ["--revision", ""],
    ["--revision", "main/../../x"], ["--revision", "x" * 5000], ["--revision", "a\nb"],
])
def test_a_traversing_or_malformed_revision_is_exit_2_with_one_line(hub, args):
    refused = hub.pull("pull", f"{REPO}:Q8_0", *args)
    assert refused.returncode == 2
    assert "not a revision" in one_line_error(refused)
    assert hub.requests() == []  # refused before asking the Hub
    assert written_outside_the_cache(hub) == []
    done = hub.pull("pull", f"{REPO}:Q8_0", "--revision", "main")
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("ref", [
    "tester/" + "R" * 5000, "../../x", "tester/..", "tester/a--b", "tester/ré", "tester/a b",
    "tester/Tiny-GGUF:" + "\x01", "/etc/passwd", "tester",
])
def test_a_malformed_reference_is_exit_2_with_one_line(hub, ref):
    refused = hub.pull("pull", ref)
    assert refused.returncode == 2
    line = one_line_error(refused)
    assert "not a Hub model reference" in line and len(line) < 500
    assert hub.requests() == []
    done = hub.pull("pull", f"{REPO}:Q8_0")
    assert done.returncode == 0, done.stderr
