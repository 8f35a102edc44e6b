"""The adapters' training data, built from what ships with Python and the installed packages:
deterministic per seed, in the shape each adapter's style promises."""

from __future__ import annotations

from selfspec.adapters.recipe_data import code_examples, docs_examples, package_examples, shout


def test_the_held_out_adapters_data_has_each_style() -> None:
    terse = package_examples("terse", 16)
    bullets = package_examples("bullets", 16)
    licences = package_examples("licences", 16)
    for examples in (terse, bullets, licences):
        assert len(examples) >= 8  # the test environment installs dozens of packages
        assert len({e.prompt for e in examples}) == len(examples)
    assert all("\n" not in e.response and len(e.response) <= 200 for e in terse)
    assert all(
        len(e.response.splitlines()) >= 3
        and all(line.startswith("- ") for line in e.response.splitlines())
        for e in bullets
    )
    assert all(len(e.response) >= 200 and "license" in e.prompt for e in licences)
    assert package_examples("bullets", 16, seed=0) == bullets  # deterministic
    assert package_examples("bullets", 16, seed=1) != bullets


def test_the_shipped_adapters_data() -> None:
    code, docs = code_examples(8), docs_examples(8)
    assert all(e.response.startswith("```python\n") for e in code)
    assert all(len(e.response) >= 80 for e in docs)
    assert shout("Hello there.").startswith("HELLO THERE.")
