"""docs/settings.md is generated from the settings definition (miserver/spec/settings.py): the
committed file is fresh, every setting is in it with its default, format and effect, a setting
added later appears by itself, the documented token syntax is what the parser accepts, and
``miserver serve --help`` shows the same defaults."""

from __future__ import annotations

import re

import pytest

from miserver import cli, docs_gen
from miserver.spec import settings, settings_reference
from miserver.spec.settings import VARIABLES, load_settings, parse_tokens

DOC = "docs/settings.md"


def test_the_committed_settings_reference_is_fresh() -> None:
    committed = (docs_gen.REPO_ROOT / DOC).read_text(encoding="utf-8")
    assert committed == docs_gen.render_all()[DOC], (
        f"{DOC} is stale: run `miserver docs` and commit the result"
    )


def test_every_setting_has_a_row_with_its_real_default_format_and_effect() -> None:
    text = settings_reference.render()
    defaults = load_settings({"MISERVER_HOME": "/x"})  # nothing set: every default
    for variable, field, kind in VARIABLES:
        assert variable in settings.DESCRIPTIONS, f"{variable} has no description"
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| `{variable}` |"))
        cells = [c.strip() for c in row.strip("|").split(" | ")]
        assert cells[1] == f"`--{variable.lower().replace('_', '-')}`"
        if field != "home":
            value = getattr(defaults, field)
            shown = cells[2].strip("`")
            if isinstance(value, bool):
                assert shown == ("1" if value else "0")
            elif value is None:
                assert shown == (
                    "auto"
                    if kind in ("batch_size", "threads", "memory_bytes", "draft_tokens")
                    else "empty"
                )
            elif isinstance(value, float):
                assert float(shown) == value
            else:
                assert shown == str(value)
            # the default written as shown is accepted and gives the same value
            if shown != "empty":  # (auto, too, reads back as None)
                again = load_settings({"MISERVER_HOME": "/x", variable: shown})
                assert getattr(again, field) == value
        assert cells[3] == settings.KIND_FORMATS[kind].replace("|", "\\|")
        assert cells[4] == settings.DESCRIPTIONS[variable]
    for variable, _flag, _fmt, _effect in settings.TOKEN_VARIABLES:
        assert f"| `{variable}` |" in text
    assert set(settings.DESCRIPTIONS) == {v for v, _, _ in VARIABLES}, "a stale description"


def test_a_setting_added_to_the_definition_appears_by_itself(monkeypatch) -> None:
    extra = ("MAX_DRAFT_TOKENS", "max_queued_requests", "pos_int")
    monkeypatch.setattr(settings, "VARIABLES", (*VARIABLES, extra))
    text = settings_reference.render()
    row = next(ln for ln in text.splitlines() if ln.startswith("| `MAX_DRAFT_TOKENS` |"))
    assert "`--max-draft-tokens`" in row and settings_reference.UNDESCRIBED in row
    monkeypatch.setitem(settings.DESCRIPTIONS, "MAX_DRAFT_TOKENS", "Draft tokens per step.")
    assert "Draft tokens per step." in settings_reference.render()
    serve_help = _serve_help()
    assert "--max-draft-tokens" in serve_help and "Draft tokens per step" in serve_help


def _serve_help() -> str:
    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    # argparse wraps lines, also after a hyphen: compare with the whitespace folded
    return _fold(sub.choices["serve"].format_help())


def _fold(text: str) -> str:
    return " ".join(text.split()).replace("- ", "-")


def test_serve_help_shows_every_default_and_format() -> None:
    help_text = _serve_help()
    for variable, fl, default, fmt, _effect in settings_reference.rows():
        if fl is None:  # WEIGHTS_TOKENS: environment only
            assert _fold("WEIGHTS_TOKENS (label:role:secret entries") in help_text
            continue
        assert fl in help_text
        assert _fold(f"Default: {default.replace('`', '')}. Overrides ${variable}.") in help_text
        assert _fold(f"Format: {fmt.replace('`', '')}.") in help_text


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_the_documented_token_syntax_is_what_the_parser_accepts(tmp_path) -> None:
    text = settings_reference.render()
    (file_form,) = _blocks(text, "text")
    tokens = parse_tokens(file_form, "WEIGHTS_TOKENS_FILE")
    assert [(t.label, t.role) for t in tokens] == [("trainer-1", "trainer"), ("oncall", "operator")]
    (shell,) = _blocks(text, "bash")
    value = re.search(r'WEIGHTS_TOKENS="(.*)"', shell)[1]
    value = value.replace("$(cat trainer.secret)", "a" * 16).replace(
        "$(cat oncall.secret)", "b" * 16
    )
    env_tokens = parse_tokens(value, "WEIGHTS_TOKENS")
    assert [t.role for t in env_tokens] == ["trainer", "operator"]
    # both forms at once, as the reference says: the file's entries are added
    path = tmp_path / "tokens"
    path.write_text("# a comment\nci:trainer:" + "c" * 16 + "\n")
    both = load_settings(
        {"MISERVER_HOME": "/x", "WEIGHTS_TOKENS": value, "WEIGHTS_TOKENS_FILE": str(path)}
    )
    assert [t.label for t in both.weights_tokens] == ["trainer-1", "oncall", "ci"]


@pytest.mark.parametrize("variable", [v for v, _, _ in VARIABLES])
def test_no_description_is_empty(variable: str) -> None:
    assert settings.DESCRIPTIONS[variable].strip().endswith(".")


def test_no_help_text_shows_markup() -> None:
    """Issue 32, item 6: ``miserver --help`` showed the docstring's double backticks."""
    import argparse

    from miserver.cli import build_parser

    parser = build_parser()
    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            texts += [p.format_help() for p in action.choices.values()]
    assert len(texts) == 5 and "miserver command: serve, check" in texts[0]
    for text in texts:
        assert "``" not in text and "`" not in text, text[:300]
