"""README.md is a landing page, and nothing the long README said was lost (issue 53).

The README stays short (at most 150 lines) and opens with exactly the two set-up
commands of a fresh Debian machine; its call is one Getting started runs
(tests/test_docs_getting_started.py), its links reach files that exist, and the script
it names for the docs is there. Every heading the README had before it was cut
(``OLD_HEADINGS``) is a row of docs/readme-map.md, whose link reaches that heading on
its new page (the strict site build checks the anchors; here each page is read for the
heading too).
"""

from __future__ import annotations

import os
import re

from .servers import ROOT

README = (ROOT / "README.md").read_text()
MAP = (ROOT / "docs" / "readme-map.md").read_text()

#: The README's sections before it was cut to a landing page, in order.
OLD_HEADINGS = [
    "Try it",
    "Deadlines and stage budgets",
    "How a request flows",
    "What passes through",
    "Responses and Messages",
    "Sessions across channels",
    "Real model backends, and a simulated one",
    "A backend over TLS: a private CA, client certificates",
    "Deployment groups and fallbacks",
    "Several gateway hosts on one Redis Cluster",
    "Providers",
    "Compliance policies",
    "Chains: speech to text, intent, generation, compliance",
    "Response cache",
    "Semantic cache",
    "Access control and overload",
    "Pages on other origins (CORS)",
    "Reload without a restart",
    "HTTP/2 and TLS",
    "Latency diagnosis",
    "Why was this request slow?",
    "The operator console",
    "Recording real traffic, replaying it with weights",
    "Spend, budgets and the audit log",
    "Metrics",
    "Benchmarks",
]


def blocks(text: str) -> list[tuple[str, str]]:
    return re.findall(r"^```(\w*)\n(.*?)^```$", text, re.S | re.M)


def test_the_readme_is_a_landing_page():
    assert len(README.splitlines()) <= 150


def test_the_readme_opens_with_the_two_setup_commands():
    lang, first = blocks(README)[0]
    assert lang == "sh"
    commands = [line.split("#")[0].strip() for line in first.splitlines()]
    assert commands == ["./scripts/serve", "./scripts/test"]
    # nothing before them but the title and the paragraph that says what it is
    before = README[: README.index("```sh")]
    assert before.count("\n## ") == 0


def test_the_readmes_call_is_one_getting_started_runs():
    page = (ROOT / "docs" / "getting-started.md").read_text()
    calls = [code for lang, code in blocks(README) if lang == "sh" and code.startswith("curl")]
    assert calls
    run_there = [code for lang, code in blocks(page) if lang == "sh"]
    for call in calls:
        assert call in run_there


def test_the_readmes_links_reach_files_and_its_scripts_exist():
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README):
        if target.startswith("http"):
            continue
        assert (ROOT / target).is_file(), target
    for script in set(re.findall(r"\./scripts/(\w+)", README)):
        path = ROOT / "scripts" / script
        assert path.is_file(), script
        assert os.access(path, os.X_OK), script


def test_every_old_heading_is_on_the_map_and_on_its_page():
    rows = re.findall(r"^\| (?:&nbsp;)*(.+?) \| \[[^\]]+\]\(([^)#]+)#([^)]+)\) \|$", MAP, re.M)
    assert [heading for heading, _, _ in rows] == OLD_HEADINGS
    for heading, page, anchor in rows:
        text = (ROOT / "docs" / page).read_text()
        headings = re.findall(r"^#+ (.+)$", text, re.M)
        slugs = {
            re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in headings
        }
        assert anchor in slugs, (heading, page, anchor)
