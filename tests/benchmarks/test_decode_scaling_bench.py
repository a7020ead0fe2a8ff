"""benchmarks/decode_scaling.py on the real tiny model at its smallest: the paged path at batches
1 and 2 and the generate path at batch 1, a few tokens, one repeat (each compile costs seconds).
The JSON line's fields, the ratio's arithmetic and the argument checks; the timings themselves
are the benchmark's business (`python -m benchmarks.decode_scaling`)."""

from __future__ import annotations

import json

import pytest

from benchmarks import decode_scaling

ARGV = ["--prompt-len", "5", "--new-tokens", "3", "--repeats", "1", "--paged-calls", "2"]


def _json_line(argv, capsys) -> dict:
    assert decode_scaling.main([*ARGV, *argv]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert out["benchmark"] == "decode_scaling" and out["model"] == "tiny_v41"
    assert (out["prompt_len"], out["new_tokens"], out["repeats"]) == (5, 3, 1)
    return out


@pytest.mark.slow  # the generate path also runs in every dsv4.generate test
def test_generate_path(capsys):
    out = _json_line(["--batches", "1", "--paths", "generate,matmuls"], capsys)
    assert "paged" not in out and out["batches"] == [1]
    assert set(out["generate"]) == {"ms_per_step"}  # one batch: no ratio
    assert out["generate"]["ms_per_step"]["1"] >= 0
    assert set(out["matmuls"]) == {"ms_per_step", "count", "mflop_per_step", "gflop_per_s"}


def test_paged_path(capsys):
    out = _json_line(["--batches", "1,2", "--paths", "paged"], capsys)
    assert "generate" not in out and out["batches"] == [1, 2]
    ms = out["paged"]["ms_per_step"]
    assert set(ms) == {"1", "2"} and min(ms.values()) > 0
    assert out["paged"]["ratio_b2_over_b1"] == pytest.approx(ms["2"] / ms["1"], abs=2e-3)
    # exact buckets by default: T = B tokens, R = B rows (no padding token, no padding row)
    assert out["paged"]["token_bucket"] == {"1": 1, "2": 2}
    assert out["paged"]["request_bucket"] == {"1": 1, "2": 2}
    assert out["paged"]["max_model_len"] == 8


def test_matmuls_path(capsys):
    out = _json_line(["--batches", "1,2", "--paths", "matmuls"], capsys)
    assert "generate" not in out and "paged" not in out
    mm = out["matmuls"]
    assert mm["count"] > 100  # 8 layers of projections, attention, mixing and experts
    assert set(mm["ms_per_step"]) == set(mm["mflop_per_step"]) == {"1", "2"}
    assert min(mm["ms_per_step"].values()) > 0
    # two rows: twice the projections, a little more for index scores over more entries
    assert (
        2 * mm["mflop_per_step"]["1"]
        <= mm["mflop_per_step"]["2"]
        <= 2.1 * mm["mflop_per_step"]["1"]
    )
    for b in ("1", "2"):
        assert mm["gflop_per_s"][b] == pytest.approx(
            mm["mflop_per_step"][b] / mm["ms_per_step"][b], rel=0.02
        )
    assert mm["ratio_b2_over_b1"] == pytest.approx(
        mm["ms_per_step"]["2"] / mm["ms_per_step"]["1"], abs=2e-3
    )
    assert "b2_over_generate_b1" not in mm  # only next to the generate path


@pytest.mark.slow  # compiles generate four times; the case itself runs in the next test
def test_rest_path(capsys):
    out = _json_line(["--batches", "1,2", "--paths", "generate,rest"], capsys)
    assert "matmuls" not in out and "paged" not in out
    rest, whole = out["rest"]["ms_per_step"], out["generate"]["ms_per_step"]
    assert set(rest) == {"1", "2"} and min(rest.values()) >= 0
    assert out["rest"]["ratio_b2_over_b1"] == pytest.approx(rest["2"] / rest["1"], abs=2e-3)
    if whole["1"]:
        assert out["rest"]["b2_over_generate_b1"] == pytest.approx(rest["2"] / whole["1"], abs=2e-3)


def test_rest_case_removes_every_product(monkeypatch):
    import jax
    import jax.numpy as jnp

    from dsv4 import layers
    from dsv4.config import tiny_v41
    from dsv4.params import init_params

    cfg = tiny_v41()
    params = init_params(cfg, jax.random.PRNGKey(0))
    prompt = jnp.full((1, 4), 7, jnp.int32)
    einsum = jnp.einsum
    case = decode_scaling.RestCase(params, cfg, prompt, 2)
    assert jnp.einsum is einsum  # the stand-in only lives while the case traces
    assert case.run(2).shape == (1, 2)

    # a product written without einsum would escape the stand-in: the case refuses to time it
    def linear(x, params, name, cfg):
        w = params[name].astype(x.dtype)
        return jax.lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((), ())))

    monkeypatch.setattr(layers, "linear", linear)
    with pytest.raises(RuntimeError, match="escaped"):
        decode_scaling.RestCase(params, cfg, prompt, 2)
    assert jnp.einsum is einsum


def test_matmul_flops_counts_nested_dots():
    import jax
    import jax.numpy as jnp

    def f(x, w, a, b):
        y = x @ w  # 2 * 3*4 * 5
        z = jnp.einsum("bij,bjk->bik", a, b)  # 2 * 2*3*4 * 5

        def body(i, c):  # a loop body: counted once
            return c + jnp.sum(x @ w)

        branch = jax.lax.cond(y[0, 0] > 0, lambda: a[0] @ b[0], lambda: a[1] @ b[1])
        return y, z, jax.lax.fori_loop(0, 3, body, 0.0), branch

    args = (jnp.ones((3, 4)), jnp.ones((4, 5)), jnp.ones((2, 3, 4)), jnp.ones((2, 4, 5)))
    found = decode_scaling.matmuls_of(jax.make_jaxpr(f)(*args).jaxpr)
    assert len(found) == 5  # x@w, the einsum, the loop's x@w, both branches
    assert decode_scaling.matmul_flops(found) == 120 + 240 + 120 + 120 + 120


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--batches", "1,x"], "--batches"),
        (["--paths", "generate,dense"], "--paths"),
        (["--new-tokens", "1"], "new_tokens=1"),
        (["--repeats", "0"], "repeats=0"),
        (["--batches", "1,8", "--token-bucket", "4"], "token_bucket=4"),
        (["--batches", "1,8", "--request-bucket", "7"], "request_bucket=7"),
        (["--batches", "1,8", "--token-bucket", "16", "--request-bucket", "8"], "request_bucket=8"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        decode_scaling.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
