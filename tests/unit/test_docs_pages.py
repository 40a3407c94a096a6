"""The README stays a five-minute read that opens with the two set-up commands, every docs page is reachable
from it, and every relative link of the README and the docs lands on a file and heading that exist."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
README_MAX_LINES = 220
# Pages written by a command of their own rather than by hand, which may not have been generated yet: a link to
# one is checked only once it exists.
GENERATED_ELSEWHERE = {"docs/hf-matrix.md": "bench/hf_matrix.py --out docs/hf-matrix.md"}
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def test_the_readme_is_at_most_220_lines():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (f"README.md has {len(lines)} lines; keep it to the overview and the quick "
                                            f"start (at most {README_MAX_LINES}) and move the rest under docs/")


def test_the_readme_opens_with_the_two_set_up_commands():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    body = [line for line in lines[1:] if line.strip()]
    assert lines[0] == "# hybrid"
    assert body[0] == "```bash" and body[3] == "```", "the README's first block must be the bash set-up block"
    demo, test = body[1], body[2]
    assert re.fullmatch(r"make demo +# .+", demo) and re.fullmatch(r"make test +# .+", test), (demo, test)


def slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # no headings inside code
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_every_relative_link_lands_on_a_file_and_heading_that_exist():
    broken = []
    for page in pages():
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            rel = resolved.relative_to(ROOT).as_posix() if resolved.is_relative_to(ROOT) else str(resolved)
            if not resolved.exists():
                if rel not in GENERATED_ELSEWHERE:
                    broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_slug_is_github_s_anchor():
    assert slug("Back to Hugging Face: `consolidate --hf`") == "back-to-hugging-face-consolidate---hf"
    assert slug("Your code on every node: `job.working_dir`") == "your-code-on-every-node-jobworking_dir"


def test_every_docs_page_is_reachable_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall(readme)}
    missing = [p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md") if p.resolve() not in linked]
    assert not missing, f"docs pages the README's 'Where to read on' does not link: {missing}"


def test_the_kuberay_manifest_is_a_raycluster_of_training_nodes_of_one_shape():
    manifest = yaml.safe_load((ROOT / "docs" / "examples" / "raycluster.yaml").read_text(encoding="utf-8"))
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayCluster"
    head = manifest["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    worker = manifest["spec"]["workerGroupSpecs"][0]
    assert head["resources"] == worker["template"]["spec"]["containers"][0]["resources"]
    assert worker["replicas"] == worker["minReplicas"] == worker["maxReplicas"]
