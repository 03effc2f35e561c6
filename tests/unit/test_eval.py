"""Held-out evaluation: accuracy where the answer is known, determinism, pass@k, and the DPO pair metrics."""


import pytest
import torch
from helpers import tiny_model

from rlrun import evaluate

PROMPTS = [f"{a}+{b}=" for a in range(5) for b in range(4)]  # one length: no padding in any batch split


def exact(completions, rows):
    return [float(c == r["answer"]) for c, r in zip(completions, rows)], {"exact": [1.0] * len(rows)}


@torch.no_grad()
def greedy_text(model, tok, prompts, n=3):
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    out = model.generate(**enc, do_sample=False, max_new_tokens=n, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id)
    response = out[:, enc.input_ids.shape[1]:]
    eos = response == tok.eos_token_id
    text = tok.batch_decode(torch.where(eos, tok.pad_token_id, response), skip_special_tokens=True)
    # tokens up to and including the first EOS (all of them when none)
    lengths = [int(e.nonzero()[0]) + 1 if e.any() else len(e) for e in eos]
    return text, lengths


def test_greedy_accuracy_where_the_answer_is_known():
    model, tok = tiny_model()
    known, lengths = greedy_text(model, tok, PROMPTS)
    # every other row's answer is what greedy decoding produces, the others' can never be produced
    rows = [{"prompt": p, "answer": k if i % 2 == 0 else "<never>"} for i, (p, k) in enumerate(zip(PROMPTS, known))]
    res = evaluate.evaluate(model, tok, rows, exact, max_new_tokens=3)
    assert res.metrics["eval/accuracy"] == 0.5
    assert res.metrics["eval/reward_mean"] == 0.5
    assert res.metrics["eval/rewards/exact/mean"] == 1.0
    assert res.metrics["eval/response_len_mean"] == pytest.approx(sum(lengths) / len(lengths))
    assert "eval/pass_at_1" not in res.metrics
    assert [s["prompt"] for s in res.samples] == PROMPTS[:4]
    assert [s["completion"] for s in res.samples] == known[:4]
    assert res.samples[0]["reward"] == 1.0 and res.samples[1]["reward"] == 0.0
    model.train()  # the mode is restored after evaluating
    evaluate.evaluate(model, tok, rows, exact, max_new_tokens=3)
    assert model.training and tok.padding_side == "left"


def test_accuracy_by_a_named_reward_and_threshold_and_per_reward_sample_columns():
    """eval.accuracy_reward / eval.accuracy_threshold: "solved" by the reward that means correct, not by a weighted
    total >= 1.0; with several rewards the samples table has a column per reward."""
    model, tok = tiny_model()
    known, _ = greedy_text(model, tok, PROMPTS)
    rows = [{"prompt": p, "answer": k if i % 2 == 0 else "<never>"} for i, (p, k) in enumerate(zip(PROMPTS, known))]

    def weighted(completions, rows):  # correct (weight 0.6) + a format bonus every completion earns (0.4)
        correct = [float(c == r["answer"]) for c, r in zip(completions, rows)]
        return [0.6 * c + 0.4 for c in correct], {"correct": correct, "format": [1.0] * len(rows)}

    by_total = evaluate.evaluate(model, tok, rows, weighted, max_new_tokens=3)
    assert by_total.metrics["eval/accuracy"] == 0.5  # 1.0 only where correct
    assert evaluate.evaluate(model, tok, rows, weighted, max_new_tokens=3,
                             accuracy_threshold=0.4).metrics["eval/accuracy"] == 1.0
    res = evaluate.evaluate(model, tok, rows, weighted, max_new_tokens=3, accuracy_reward="format")
    assert res.metrics["eval/accuracy"] == 1.0
    assert res.samples[0]["rewards/correct"] == 1.0 and res.samples[1]["rewards/correct"] == 0.0
    assert res.samples[0]["rewards/format"] == 1.0 and res.samples[0]["reward"] == pytest.approx(1.0)
    assert "rewards/exact" not in evaluate.evaluate(model, tok, rows, exact, max_new_tokens=3).samples[0]  # one
    with pytest.raises(evaluate.TaskError, match=r"eval.accuracy_reward='nope' is not a reward of this task; its "
                                                 r"rewards: \['correct', 'format'\]"):
        evaluate.evaluate(model, tok, rows, weighted, max_new_tokens=3, accuracy_reward="nope")


def test_deterministic_and_independent_of_batch_size():
    model, tok = tiny_model()
    rows = [{"prompt": p, "answer": "3"} for p in PROMPTS]
    seen = []

    def recording(completions, rows_):
        seen.append(list(completions))
        return [float(c[:1] in "0123") for c in completions], {}

    kw = dict(max_new_tokens=3, greedy=False, samples=4, temperature=1.0, seed=7)
    a = evaluate.evaluate(model, tok, rows, recording, **kw)
    b = evaluate.evaluate(model, tok, rows, recording, batch_size=5, **kw)
    assert a.metrics == b.metrics and seen[0] == seen[1]
    c = evaluate.evaluate(model, tok, rows, recording, **{**kw, "seed": 8})
    assert seen[2] != seen[0]  # another seed draws other samples
    assert c.metrics.keys() == a.metrics.keys()
    g1 = evaluate.evaluate(model, tok, rows, exact, max_new_tokens=3)
    g2 = evaluate.evaluate(model, tok, rows, exact, max_new_tokens=3, batch_size=3)
    assert g1.metrics == g2.metrics and g1.samples == g2.samples


def test_pass_at_k_from_the_samples():
    model, tok = tiny_model(seed=1)
    rows = [{"prompt": p, "answer": "?"} for p in PROMPTS]
    seen = []

    def first_char_is_digit(completions, rows_):
        seen.extend(completions)
        return [float(c[:1].isdigit()) for c in completions], {}

    k = 6
    res = evaluate.evaluate(model, tok, rows, first_char_is_digit, max_new_tokens=3, greedy=False, samples=k, seed=0)
    solved = torch.tensor([c[:1].isdigit() for c in seen]).view(len(rows), k)  # prompt-major order
    assert res.metrics["eval/accuracy"] == pytest.approx(solved.double().mean().item())
    assert res.metrics[f"eval/pass_at_{k}"] == pytest.approx(solved.any(1).double().mean().item())
    assert 0 < res.metrics["eval/accuracy"] < res.metrics[f"eval/pass_at_{k}"]  # a random model: some, not all
    assert len(res.samples) == 4  # one (the first) sample per shown prompt


def test_greedy_with_several_samples_is_refused():
    model, tok = tiny_model()
    with pytest.raises(ValueError, match="greedy"):
        evaluate.evaluate(model, tok, [{"prompt": "1+1=", "answer": "2"}], exact, max_new_tokens=2, samples=4)


def test_scorer_adapts_a_per_completion_reward():
    from rlrun.tasks import partial_credit

    totals, per = evaluate.scorer(partial_credit)(["7", "8"], [{"answer": "7"}, {"answer": "7"}])
    assert totals == [1.0, partial_credit("8", "7")] and per == {}


def seq_logprob(model, tok, prompt, response):
    p = tok(prompt, add_special_tokens=False).input_ids
    r = tok(response, add_special_tokens=False).input_ids + [tok.eos_token_id]
    ids = torch.tensor([p + r])
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
    return sum(logp[len(p) - 1 + i, t].item() for i, t in enumerate(r))


def dpo_functions():
    """The DPO recipe's encode_pairs / pair_logprobs (rlrun.recipes.dpo; rlrun.loop before the split)."""
    try:
        from rlrun.recipes.dpo import encode_pairs, pair_logprobs
    except ImportError:
        from types import SimpleNamespace

        from rlrun.loop import encode_pairs
        from rlrun.loop import pair_logprobs as by_cfg

        def pair_logprobs(model, batch, head, size, average):
            return by_cfg(model, batch, head, SimpleNamespace(size=size), average)
    return {"encode_pairs": encode_pairs, "pair_logprobs": pair_logprobs}


@torch.no_grad()
def test_pair_metrics_match_a_plain_computation():
    policy, tok = tiny_model(seed=0)
    reference, _ = tiny_model(seed=1)
    pairs = [{"prompt": "3+4=", "chosen": "7", "rejected": "8"}, {"prompt": "2+2=", "chosen": "4", "rejected": "11"},
             {"prompt": "9+9=", "chosen": "18", "rejected": "0"}]
    beta = 0.1
    res = evaluate.evaluate_pairs(policy, reference, tok, pairs, beta=beta, batch_size=2, **dpo_functions())
    margins = [beta * ((seq_logprob(policy, tok, p["prompt"], p["chosen"])
                        - seq_logprob(reference, tok, p["prompt"], p["chosen"]))
                       - (seq_logprob(policy, tok, p["prompt"], p["rejected"])
                          - seq_logprob(reference, tok, p["prompt"], p["rejected"]))) for p in pairs]
    assert res.metrics["eval/margin"] == pytest.approx(sum(margins) / 3, abs=1e-5)
    assert res.metrics["eval/accuracy"] == pytest.approx(sum(m > 0 for m in margins) / 3)
    assert [s["margin"] for s in res.samples] == pytest.approx(margins, abs=1e-5)
    same = evaluate.evaluate_pairs(policy, policy, tok, pairs, beta=beta, **dpo_functions())
    assert same.metrics == {"eval/accuracy": 0.0, "eval/margin": 0.0}
