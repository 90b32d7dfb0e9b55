"""On-policy distillation: reverse-KL advantages from a teacher folder, loss, errors."""
import miles
import pytest
import torch
from miles import ConfigError, MilesError
from miles.config import resolve
from miles.testing import TinySpec, assert_lazy_registration, char_tokenizer, make_group
from miles_plugin_distill.algorithm import Distill
from miles_plugin_distill.config import DistillConfig
from miles_rlmath import group_advantages


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    """A tiny random causal LM saved as a Hugging Face folder, with the char tokenizer."""
    path = tmp_path_factory.mktemp("teacher")
    tok = char_tokenizer()
    TinySpec(hidden=32, seed=7).build_model(tok).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def teacher_scores(path, samples):
    """Reference: the teacher's log-probs computed one sample at a time, without padding."""
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path).eval()
    out = []
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        lp = torch.log_softmax(m(input_ids=ids).logits[0, len(s.prompt_ids) - 1:-1].float(), -1)
        out.append(lp.gather(-1, torch.tensor(s.response_ids)[:, None]).squeeze(-1).tolist())
    return out


def groups_with_text():
    tok = char_tokenizer()
    groups = []
    for prompt, responses in (("12+3=", ["15", "16"]), ("4+4=", ["8", "08", "9"])):
        task = miles.Task(prompt)
        p = tok.encode(prompt, add_special_tokens=False)
        samples = [miles.Sample(task, prompt_ids=p, response_ids=tok.encode(r, add_special_tokens=False),
                                response=r, logprobs=[-0.5] * len(r), reward=float(i == 0))
                   for i, r in enumerate(responses)]
        groups.append(miles.Group(task, samples))
    return groups


def test_pure_distillation_advantage_is_teacher_minus_student(teacher_dir):
    algo = Distill(DistillConfig(teacher=teacher_dir, kl_coef=2.0))
    groups = groups_with_text()
    adv = algo.advantages(groups)
    want = teacher_scores(teacher_dir, [s for g in groups for s in g.samples])
    got = [a for per_group in adv for a in per_group]
    for a, t, s in zip(got, want, [s for g in groups for s in g.samples]):
        # A_t = kl_coef * (logp_teacher - logp_student); the student's log-probs are -0.5
        assert a == pytest.approx([2.0 * (x + 0.5) for x in t], abs=1e-5)
        assert s.extensions["distill"]["teacher_logprobs"] == pytest.approx(t, abs=1e-5)
    assert algo.keep(make_group([1.0, 1.0]))  # equal rewards still carry a per-token signal


def test_reward_term_adds_group_advantages(teacher_dir):
    pure = Distill(DistillConfig(teacher=teacher_dir)).advantages(groups_with_text())
    mixed = Distill(DistillConfig(teacher=teacher_dir, reward_coef=0.5)).advantages(groups_with_text())
    rl = [group_advantages([1.0, 0.0]), group_advantages([1.0, 0.0, 0.0])]
    for g_pure, g_mixed, g_rl in zip(pure, mixed, rl):
        for a_pure, a_mixed, r in zip(g_pure, g_mixed, g_rl):
            assert a_mixed == pytest.approx([x + 0.5 * r for x in a_pure])


def test_reward_advantages_are_the_shared_group_advantages():
    # mean 1/3, deviations (2/3, -1/3, -1/3), unbiased std sqrt(1/3)
    a = group_advantages([1, 0, 0])
    assert a == pytest.approx([0.6667 / 0.57735, -0.3333 / 0.57735, -0.3333 / 0.57735], abs=1e-3)
    assert group_advantages([1.0]) == [0.0] and group_advantages([1, 1], False) == [0.0, 0.0]


def test_loss_is_policy_gradient_on_token_advantages(teacher_dir):
    algo = Distill(DistillConfig(teacher=teacher_dir))
    groups = groups_with_text()
    samples = [s for g in groups for s in g.samples]
    advs = [a for per_group in algo.advantages(groups) for a in per_group]
    batch = algo.make_batch(samples, 0, advs)
    assert batch.teacher_logprobs.shape == batch.loss_mask.shape
    lp = batch.rollout_logprobs.clone().requires_grad_(True)
    loss, m = algo.loss(batch, lp)
    # ratio 1 on-policy: loss = -token_mean(A), gradient -A / tokens on every trained token
    tokens = batch.loss_mask.sum()
    assert loss.item() == pytest.approx(float(-(batch.advantages * batch.loss_mask).sum() / tokens), abs=1e-6)
    loss.backward()
    torch.testing.assert_close(lp.grad, -batch.advantages * batch.loss_mask / tokens)
    # the reverse-KL estimate is the mean of logp_student - logp_teacher over the tokens
    want = float(((batch.rollout_logprobs - batch.teacher_logprobs) * batch.loss_mask).sum() / tokens)
    assert m["distill_reverse_kl"] == pytest.approx(want, abs=1e-5)


def test_reverse_kl_falls_under_its_own_gradient():
    """On one categorical step, repeated on-policy updates with A = log p_t - log p_s shrink
    KL(student || teacher): the advantage is the reverse KL's score-function gradient."""
    torch.manual_seed(0)
    teacher = torch.log_softmax(torch.tensor([2.0, 0.0, -1.0, 1.0]), -1)
    logits = torch.zeros(4, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)

    def kl():
        s = torch.log_softmax(logits.detach(), -1)
        return float((s.exp() * (s - teacher)).sum())
    start = kl()
    for _ in range(200):
        s = torch.log_softmax(logits, -1)
        x = torch.multinomial(s.exp().detach(), 64, replacement=True)
        adv = (teacher[x] - s[x]).detach()
        opt.zero_grad()
        (-(adv * s[x]).mean()).backward()
        opt.step()
    assert kl() < 0.1 * start


def test_missing_teacher_names_folder_and_command(tmp_path):
    pm = miles.make_plugin_manager()
    with pytest.raises(ConfigError, match=r"teacher folder .*nope does not exist.*miles export runs/sft"):
        resolve(pm, {"algorithm": {"name": "distill", "teacher": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match="no config.json"):
        resolve(pm, {"algorithm": {"name": "distill", "teacher": str(tmp_path)}})


def test_vocabulary_mismatch_is_an_error(teacher_dir):
    g = groups_with_text()
    g[0].samples[0].response = "xyz"  # text the teacher's tokenizer does not decode these ids to
    with pytest.raises(MilesError, match="same tokenizer"):
        Distill(DistillConfig(teacher=teacher_dir)).advantages(g)


def test_registration_is_lazy():
    assert_lazy_registration("miles_plugin_distill", "algorithms", "distill")
