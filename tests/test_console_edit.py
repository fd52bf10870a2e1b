"""The console's config editor: a route's steps reordered and switched in the file's own
text, every comment and every other line kept (pure, no files)."""

from __future__ import annotations

import tomllib

import pytest

from aiserve_trio.console.edit import EditError, StepState, read_steps, set_steps

CONFIG = '''\
# The bank's gateway. Keep this comment.
[server]
name = "bank"   # shown in logs

[[routes]]
path = "/v1/chat/completions"
name = "chat"
adapter = "mock"

# Speech first: the phone line sends audio.
[[routes.steps]]
name = "stt"      # whisper-small
kind = "transcribe"
# the model is picked per language
language = "auto"

# Then what the customer wants.
[[routes.steps]]
name = "intent"
kind = "classify"
enabled = true   # checked daily

[[routes.steps]]
name = "answer"
kind = "generate"
# streams its tokens

# ---- embeddings ----
[[routes]]
path = "/v1/embeddings"
name = "embeddings"
kind = "embeddings"
adapter = "mock"
'''
CHAT = "/v1/chat/completions"


def S(name: str, enabled: bool = True) -> StepState:
    return StepState(name, enabled)


def names(text: str, path: str = CHAT) -> list[tuple[str, bool]]:
    return [(s.name, s.enabled) for s in read_steps(text, path)]


def comments(text: str) -> list[str]:
    return sorted(line.split("#", 1)[1].strip() for line in text.splitlines() if "#" in line)


def block(text: str, step: str) -> str:
    """The lines from the comment above ``step``'s header to its last line."""
    lines = text.splitlines()
    at = lines.index(f'name = "{step}"') if f'name = "{step}"' in lines else next(
        i for i, line in enumerate(lines) if line.startswith(f'name = "{step}"')
    )
    start = at - 1  # the header
    while start > 0 and lines[start - 1].startswith("#"):
        start -= 1
    end = at
    while end + 1 < len(lines) and lines[end + 1] and not lines[end + 1].startswith("[["):
        end += 1
    return "\n".join(lines[start : end + 1])


def test_a_new_order_moves_the_tables_with_their_comments() -> None:
    out = set_steps(CONFIG, CHAT, [S("answer"), S("stt"), S("intent")])
    assert names(out) == [("answer", True), ("stt", True), ("intent", True)]
    assert comments(out) == comments(CONFIG)
    # Each step took the comment above its header and those inside it along.
    assert block(out, "stt") == block(CONFIG, "stt")
    assert block(out, "stt").startswith("# Speech first")
    assert block(out, "intent").startswith("# Then what the customer wants.")
    assert block(out, "intent").endswith("enabled = true   # checked daily")
    # A comment right below a step's last line went with it too.
    assert block(out, "answer") == '[[routes.steps]]\nname = "answer"\nkind = "generate"\n# streams its tokens'
    # The comment above the next route stays above it.
    assert '# checked daily\n\n# ---- embeddings ----\n[[routes]]\npath = "/v1/embeddings"' in out
    # Everything outside the steps is byte for byte the same.
    head = CONFIG[: CONFIG.index("# Speech first")]
    tail = CONFIG[CONFIG.index("# ---- embeddings") :]
    assert out.startswith(head + '[[routes.steps]]\nname = "answer"\n')
    assert '# streams its tokens\n\n# ---- embeddings' not in out
    assert out.endswith(tail)
    assert sorted(out.splitlines()) == sorted(CONFIG.splitlines())
    doc = tomllib.loads(out)
    assert doc["routes"][1] == tomllib.loads(CONFIG)["routes"][1]
    assert doc["server"] == {"name": "bank"}


def test_the_same_order_gives_the_same_text() -> None:
    assert set_steps(CONFIG, CHAT, [S("stt"), S("intent"), S("answer")]) == CONFIG


def test_moving_back_restores_the_file() -> None:
    moved = set_steps(CONFIG, CHAT, [S("intent"), S("answer"), S("stt")])
    assert moved != CONFIG
    assert set_steps(moved, CHAT, [S("stt"), S("intent"), S("answer")]) == CONFIG


def test_switching_off_edits_the_enabled_line_or_adds_one() -> None:
    out = set_steps(CONFIG, CHAT, [S("stt", False), S("intent", False), S("answer")])
    assert names(out) == [("stt", False), ("intent", False), ("answer", True)]
    # An existing line keeps its comment; a step without one gets a line after its last key.
    assert "enabled = false   # checked daily" in out
    assert 'language = "auto"\nenabled = false\n' in out
    changed = [
        (a, b) for a, b in zip(CONFIG.splitlines(), out.splitlines(), strict=False) if a != b
    ]
    assert changed[0] == ("", "enabled = false")  # the first line that differs is the new one
    back = set_steps(out, CHAT, [S("stt"), S("intent"), S("answer")])
    assert names(back) == [("stt", True), ("intent", True), ("answer", True)]
    assert "enabled = true   # checked daily" in back


def test_a_step_with_a_table_of_its_own_gets_enabled_before_that_table() -> None:
    text = CONFIG.replace(
        'name = "answer"\nkind = "generate"\n',
        'name = "answer"\nkind = "generate"\n\n[routes.steps.params]\ntemperature = 0.2\n# cool\n',
    )
    out = set_steps(text, CHAT, [S("answer", False), S("stt"), S("intent")])
    doc = tomllib.loads(out)
    first = doc["routes"][0]["steps"][0]
    assert first == {"name": "answer", "kind": "generate", "enabled": False, "params": {"temperature": 0.2}}
    assert comments(out) == comments(text)


def test_the_first_step_with_no_comment_above_it_and_a_table_before_the_steps() -> None:
    text = '''[[routes]]
path = "/a"
adapter = "m"
[routes.deadline]
default_ms = 5000
[[routes.steps]]
name = "one"
kind = "generate"
[[routes.steps]]
name = "two"
kind = "rewrite"
'''
    out = set_steps(text, "/a", [S("two"), S("one")])
    assert names(out, "/a") == [("two", True), ("one", True)]
    assert tomllib.loads(out)["routes"][0]["deadline"] == {"default_ms": 5000}
    assert set_steps(out, "/a", [S("one"), S("two")]) == text


@pytest.mark.parametrize(
    ("steps", "code", "message"),
    [
        ([S("stt"), S("intent")], "invalid_steps", "missing: answer"),
        ([S("stt"), S("intent"), S("answer"), S("stt")], "invalid_steps", "named twice"),
        ([S("stt"), S("intent"), S("answr")], "unknown_step", "no step 'answr'"),
    ],
)
def test_the_new_order_must_name_every_step_once(steps: list[StepState], code: str, message: str) -> None:
    with pytest.raises(EditError, match=message) as err:
        set_steps(CONFIG, CHAT, steps)
    assert err.value.code == code


def test_an_unknown_route_a_route_without_steps_and_inline_steps_are_refused() -> None:
    with pytest.raises(EditError, match="no route with path /v1/nope") as err:
        set_steps(CONFIG, "/v1/nope", [])
    assert err.value.code == "route_not_found"
    with pytest.raises(EditError, match="has no steps"):
        set_steps(CONFIG, "/v1/embeddings", [])
    inline = '[[routes]]\npath = "/a"\nsteps = [{name = "x", kind = "generate"}]\n'
    with pytest.raises(EditError, match=r"inline array.*\[\[routes.steps\]\]") as err:
        set_steps(inline, "/a", [S("x")])
    assert err.value.code == "steps_not_editable"


def test_a_file_that_is_not_toml_is_refused() -> None:
    with pytest.raises(EditError, match="not valid TOML") as err:
        set_steps(CONFIG + "\n[[routes\n", CHAT, [S("stt"), S("intent"), S("answer")])
    assert err.value.code == "invalid_config"


def test_a_step_without_a_name_goes_by_its_kind() -> None:
    text = '[[routes]]\npath = "/a"\n[[routes.steps]]\nkind = "transcribe"\n[[routes.steps]]\nkind = "generate"\n'
    out = set_steps(text, "/a", [S("generate", False), S("transcribe")])
    assert names(out, "/a") == [("generate", False), ("transcribe", True)]
    assert "name" not in out


def test_read_steps_defaults_enabled_to_true() -> None:
    assert read_steps(CONFIG, CHAT) == [
        StepState("stt", True, "transcribe"),
        StepState("intent", True, "classify"),
        StepState("answer", True, "generate"),
    ]


def test_an_edit_that_would_change_anything_else_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # Simulate the editor going wrong: the rendered text loses a line it should keep.
    from tomlkit import TOMLDocument

    real = TOMLDocument.as_string

    def lossy(self: TOMLDocument) -> str:
        return real(self).replace('language = "auto"\n', "")

    monkeypatch.setattr(TOMLDocument, "as_string", lossy)
    with pytest.raises(EditError, match="could not be rewritten") as err:
        set_steps(CONFIG, CHAT, [S("answer"), S("stt"), S("intent")])
    assert err.value.code == "edit_failed"
