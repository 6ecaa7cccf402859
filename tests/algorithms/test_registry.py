"""The registry's strictness, its error texts, the contract every variant follows, and one-file extensibility."""

import inspect
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import algorithms
from algorithms.grpo import grpo_loss

REQUIRED = {
    "grpo": ("free", {"eps_low": 0.2, "eps_high": 0.27}),
    "grpo_rr": ("replay", {"eps_low": 0.2, "eps_high": 0.27}),
    "gspo": ("free", {"eps_low": 3e-4, "eps_high": 4e-4}),
    "gspo_token": ("free", {"eps_low": 3e-4, "eps_high": 4e-4}),
    "gspo_rr": ("replay", {"eps_low": 3e-4, "eps_high": 4e-4}),
    "dapo": ("free", {"eps_low": 0.2, "eps_high": 0.28}),
    "dr_grpo": ("free", {"eps_low": 0.2, "eps_high": 0.2, "norm_len": 0}),
    "cispo": ("free", {"eps_max": 5.0}),
    "gmpo": ("free", {"eps_low": 0.4, "eps_high": 0.4}),
    "sapo": ("free", {"tau_pos": 1.0, "tau_neg": 1.05}),
    "grpo_tis": ("free", {"eps_low": 0.2, "eps_high": 0.27, "tis_c": 2.0}),
}
ROOT = Path(algorithms.__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(REQUIRED))
def test_required_variants_have_paper_defaults(name: str) -> None:
    routing, hparams = REQUIRED[name]
    alg = algorithms.get(name)
    assert alg.name == name and alg.routing == routing
    assert dict(alg.hparams) == hparams
    assert alg.label and alg.color.startswith("#")
    # the docstring cites its source and, for every variant but the reference, lists its differences
    assert ("Differences from" in alg.doc) if name != "grpo" else ("arXiv" in alg.doc)


def test_unknown_name_lists_every_valid_name() -> None:
    with pytest.raises(algorithms.UnknownAlgorithmError) as err:
        algorithms.get("gpso")
    text = str(err.value)
    assert "unknown algorithm 'gpso'" in text
    for name in algorithms.names():
        assert name in text


def test_taken_name_raises_and_keeps_the_original() -> None:
    original = algorithms.get("grpo")
    with pytest.raises(ValueError, match="'grpo' is already registered"):
        algorithms.register("grpo", label="impostor")(grpo_loss)
    assert algorithms.get("grpo") is original


def test_register_validates_its_arguments() -> None:
    with pytest.raises(ValueError, match="routing='sticky'; valid: free, replay, rollout_replay"):
        algorithms.register("test_bad", label="bad", routing="sticky")
    with pytest.raises(ValueError, match="lower-case identifier"):
        algorithms.register("Bad-Name", label="bad")
    with pytest.raises(ValueError, match="ratio_level = 'group'; valid: token, sequence"):
        algorithms.ratio_level("group")


def docs_one_liner() -> str:
    """The one-line registration docs/algorithms.md shows for a variant reusing an existing loss."""
    text = (ROOT / "docs" / "algorithms.md").read_text()
    (line,) = re.findall(r'`(register\("gspo_rr".*?\)\(gspo_loss\))`', text)
    return line


def test_the_docs_variant_table_is_the_commands_output(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/algorithms.md shows `python -m algorithms` as it prints now."""
    from algorithms.__main__ import main

    text = (ROOT / "docs" / "algorithms.md").read_text()
    (shown,) = re.findall(r"<!-- python -m algorithms -->\n```text\n(.*?)```", text, re.S)
    main([])
    assert shown == capsys.readouterr().out


def test_a_registration_has_the_ratio_level_of_the_loss_it_wraps() -> None:
    """docs/algorithms.md's one-liner, followed literally (label filled in), registers GSPO's sequence-level loss as
    sequence-level, as does a correction wrapping it; the level is declared once, on the loss."""
    from algorithms.gspo import gspo_loss
    from algorithms.registry import register

    line = docs_one_liner().replace('"gspo_rr"', '"test_gspo_rr_doc"').replace("label=...", 'label="x"')
    try:
        exec(line, {"register": register, "gspo_loss": gspo_loss})
        algorithms.register("test_gspo_mis_doc", label="y")(algorithms.with_mis(gspo_loss))
        assert algorithms.get("test_gspo_rr_doc").ratio_level == "sequence" == algorithms.get("gspo").ratio_level
        assert algorithms.get("test_gspo_mis_doc").ratio_level == "sequence"
        assert algorithms.get("test_gspo_rr_doc").routing == "replay"
    finally:
        algorithms.unregister("test_gspo_rr_doc")
        algorithms.unregister("test_gspo_mis_doc")
    assert {n: algorithms.get(n).ratio_level for n in ("grpo", "grpo_rr", "gspo_rr", "gspo_token", "gmpo")} == {
        "grpo": "token",
        "grpo_rr": "token",
        "gspo_rr": "sequence",
        "gspo_token": "token",
        "gmpo": "sequence",
    }


def test_hparams_need_defaults() -> None:
    def loss(logp, old_logp, advantages, mask, *, eps):  # type: ignore[no-untyped-def]
        raise AssertionError

    with pytest.raises(TypeError, match="hyper-parameter 'eps' needs a default"):
        algorithms.register("test_nodefault", label="x")(loss)
    assert "test_nodefault" not in algorithms.names()


def test_names_are_in_registration_order() -> None:
    names = algorithms.names()
    assert set(REQUIRED) <= set(names)
    assert len(names) == len(set(names))
    try:
        algorithms.register("test_last", label="last")(grpo_loss)
        assert algorithms.names() == [*names, "test_last"]
        # registered without a colour: one that no other variant has
        assert algorithms.get("test_last").color not in {algorithms.get(name).color for name in names}
    finally:
        algorithms.unregister("test_last")


def test_routing_variants_and_replay_partner_follow_the_loss_not_the_name() -> None:
    assert algorithms.routing_variants("grpo") == ["grpo", "grpo_r3", "grpo_rr"]
    assert algorithms.routing_variants("grpo_rr") == algorithms.routing_variants("grpo")
    assert algorithms.routing_variants("gspo") == ["gspo", "gspo_rr"]
    assert algorithms.routing_variants("grpo_tis") == ["grpo_tis"]  # a wrapped loss is another loss
    assert algorithms.replay_partner("grpo") == "grpo_rr" and algorithms.replay_partner("grpo_r3") == "grpo_rr"
    assert algorithms.replay_partner("gspo") == "gspo_rr"
    assert algorithms.replay_partner("grpo_rr") is None and algorithms.replay_partner("sapo") is None
    with pytest.raises(algorithms.UnknownAlgorithmError):
        algorithms.replay_partner("gpso")
    try:  # a replay variant registered under any name is found
        algorithms.register("test_sapo_replayed", label="x", routing="replay")(algorithms.get("sapo").loss_fn)
        assert algorithms.replay_partner("sapo") == "test_sapo_replayed"
        assert algorithms.routing_variants("test_sapo_replayed") == ["sapo", "test_sapo_replayed"]
    finally:
        algorithms.unregister("test_sapo_replayed")


def test_check_hparams_names_field_value_and_valid_choices() -> None:
    alg = algorithms.get("grpo")
    with pytest.raises(ValueError, match=r"grpo.eps_low = -0.1: valid range is \[0.0, 1.0\)"):
        alg.check_hparams({"eps_low": -0.1})
    with pytest.raises(ValueError, match="has no hyper-parameter 'clip'; valid: eps_low, eps_high"):
        alg.check_hparams({"clip": 0.2})
    with pytest.raises(ValueError, match="must be a finite number"):
        alg.check_hparams({"eps_high": float("nan")})
    tuned = alg.with_hparams(eps_high=0.3)
    assert tuned.hparams["eps_high"] == 0.3 and alg.hparams["eps_high"] == 0.27
    with pytest.raises(TypeError, match="unknown hyper-parameter"):
        alg.loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1), torch.ones(1, 1), clip=0.1)


@pytest.mark.parametrize("name", algorithms.names())
def test_contract(name: str) -> None:
    """Every registered variant: loss signature, metric vocabulary, advantages shape, scalar loss with gradient."""
    alg = algorithms.get(name)
    assert alg.routing in algorithms.ROUTING_MODES
    params = list(inspect.signature(alg.loss_fn).parameters)
    assert params[:4] == ["logp", "old_logp", "advantages", "mask"]
    gen = torch.Generator().manual_seed(0)
    b, t = 8, 5
    mask = (torch.arange(t)[None] < torch.randint(1, t + 1, (b,), generator=gen)[:, None]).float()
    old = -torch.rand(b, t, generator=gen) * 2
    logp = (old + 0.3 * torch.randn(b, t, generator=gen)).requires_grad_(True)
    adv = alg.advantages(torch.rand(b, generator=gen), group_size=4)
    assert adv.shape == (b,)
    extra = {"rollout_logp": old + 0.1 * torch.randn(b, t, generator=gen)} if alg.needs_rollout_logp else {}
    loss, metrics = alg.loss(logp, old, adv, mask, **alg.hparams, **extra)
    assert loss.dim() == 0 and torch.isfinite(loss)
    assert set(algorithms.LOSS_METRICS) <= set(metrics)
    assert all(isinstance(v, float) for v in metrics.values())
    loss.backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    assert (logp.grad[mask == 0] == 0).all()


def readme_variant() -> tuple[str, str]:
    """The example file of the README's "Add an algorithm" section: (file name, source)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Add an algorithm", 1)[1]
    block = section.split("```python\n", 1)[1].split("```", 1)[0]
    first, source = block.split("\n", 1)
    assert first.startswith("# algorithms/")
    return first.removeprefix("# algorithms/"), source


def readme_variant_package(tmp_path: Path) -> tuple[Path, str]:
    """A copy of algorithms/ under `tmp_path` with the README's example dropped in: (the copy's root, variant name)."""
    filename, source = readme_variant()
    pkg = tmp_path / "algorithms"
    shutil.copytree(ROOT / "algorithms", pkg, ignore=shutil.ignore_patterns("__pycache__"))
    (pkg / filename).write_text(source)
    return tmp_path, filename.removesuffix(".py")


def test_a_new_variant_is_one_file(tmp_path: Path) -> None:
    """The README's example dropped into algorithms/ (of a copy of the package) is registered and follows the
    contract, with nothing else touched."""
    root, name = readme_variant_package(tmp_path)
    code = textwrap.dedent(
        f"""
        import torch, algorithms
        a = algorithms.get({name!r})
        mask = torch.ones(4, 3)
        logp = torch.full((4, 3), -1.0, requires_grad=True)
        loss, m = a.loss(logp, logp.detach() - 0.5, a.advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 2), mask)
        loss.backward()
        print(algorithms.names().count({name!r}), dict(a.hparams), a.doc.splitlines()[0], sorted(m))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    metrics = sorted(algorithms.LOSS_METRICS)
    expected = f"1 {{'eps_low': 0.2, 'eps_high': 0.28}} GRPO with DAPO's clip-higher (arXiv 2503.14476). {metrics}"
    assert out.stdout.strip() == expected


def test_the_readme_variant_passes_the_contract_and_planning_imports_no_torch(tmp_path: Path) -> None:
    """The README's example as written (it imports torch at module level) in a copy of the package: this file's
    contract test passes on it, and the workflow's planning (tests/sweeps/helpers.py's probe: the rule
    files' imports, every shipped sweep expanded and placed) sees it and still imports no torch."""
    from tests.sweeps.helpers import planning_probe

    root, name = readme_variant_package(tmp_path)
    assert "\nimport torch\n" in readme_variant()[1]
    code = (
        f"import sys; sys.path.insert(0, {str(root)!r}); import algorithms, pytest; "
        f"assert algorithms.__file__.startswith({str(root)!r}); "
        f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-p', 'no:xdist', "
        f"{str(Path(__file__).resolve())!r} + '::test_contract[{name}]']))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr
    probe = planning_probe(root)
    assert name in probe["algorithms"]
    assert not probe["torch"], "planning imported torch; first import from:\n  " + "\n  ".join(probe["chain"])
