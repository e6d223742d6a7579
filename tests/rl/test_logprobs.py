import pytest
import torch

from lightning_logra.rl.logprobs import sequence_logprobs, token_logprobs
from tests.helpers.models import left_padded_batch, tiny_qwen2


def naive_logprobs(hidden, weight, bias, targets, temperature):
    logp = torch.log_softmax((hidden @ weight.T + bias) / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_token_logprobs_hand_computed():
    # Two tokens with logits (0, ln 3) -> probabilities (1/4, 3/4).
    hidden = torch.tensor([[1.0]])
    weight = torch.tensor([[0.0], [torch.log(torch.tensor(3.0))]])
    targets = torch.tensor([1])
    lp, ent = token_logprobs(hidden, weight, None, targets, return_entropy=True)
    torch.testing.assert_close(lp, torch.log(torch.tensor([0.75])))
    expected_entropy = -(0.25 * torch.log(torch.tensor(0.25)) + 0.75 * torch.log(torch.tensor(0.75)))
    torch.testing.assert_close(ent, expected_entropy.reshape(1))
    # Temperature 2 halves the logits: probabilities (1, sqrt 3) / (1 + sqrt 3).
    lp_t = token_logprobs(hidden, weight, None, targets, temperature=2.0)
    root3 = torch.tensor(3.0).sqrt()
    torch.testing.assert_close(lp_t, torch.log(root3 / (1 + root3)).reshape(1))


@pytest.mark.parametrize("chunk_size", [1, 5, 1024])
def test_token_logprobs_matches_full_logits_with_gradients(chunk_size):
    torch.manual_seed(0)
    hidden = torch.randn(3, 4, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    bias = torch.randn(11, requires_grad=True)
    targets = torch.randint(0, 11, (3, 4))
    lp, ent = token_logprobs(hidden, weight, bias, targets, temperature=0.7, chunk_size=chunk_size, return_entropy=True)
    ref_lp, ref_ent = naive_logprobs(hidden, weight, bias, targets, 0.7)
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    upstream = torch.randn(3, 4)
    grads = torch.autograd.grad((lp * upstream).sum() + ent.sum(), (hidden, weight, bias))
    ref_grads = torch.autograd.grad((ref_lp * upstream).sum() + ref_ent.sum(), (hidden, weight, bias))
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def saved_for_backward(function):
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(tuple(t.shape)) or t, lambda t: t):
        function()
    return shapes


def test_token_logprobs_saves_only_its_inputs_for_backward():
    vocab = 64
    hidden = torch.randn(12, 8, requires_grad=True)
    weight = torch.randn(vocab, 8)
    targets = torch.randint(0, vocab, (12,))
    chunked = saved_for_backward(lambda: token_logprobs(hidden, weight, None, targets, chunk_size=4))
    assert chunked == [(4, 8), (vocab, 8), (4,)] * 3  # each chunk's hidden, the weight, its targets
    naive = saved_for_backward(lambda: naive_logprobs(hidden, weight, torch.zeros(vocab), targets, 1.0))
    assert (12, vocab) in naive  # what the chunks avoid: full logits kept for backward


def test_token_logprobs_rejects_bad_shapes():
    with pytest.raises(ValueError, match="hidden"):
        token_logprobs(torch.zeros(2, 3, 4), torch.zeros(5, 4), None, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 4), torch.zeros(5, 4), None, torch.zeros(2, dtype=torch.long), temperature=0)


def naive_sequence_logprobs(model, input_ids, attention_mask, temperature):
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp = torch.log_softmax(logits[:, :-1] / temperature, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1), -(logp.exp() * logp).sum(-1)


def test_sequence_logprobs_matches_full_logits_on_qwen2_with_gradients():
    model = tiny_qwen2()
    input_ids, attention_mask = left_padded_batch()
    valid = (attention_mask[:, :-1] * attention_mask[:, 1:]).bool()
    lp, ent = sequence_logprobs(model, input_ids, attention_mask, temperature=0.8, chunk_size=3, return_entropy=True)
    assert lp.shape == ent.shape == (2, 5) and lp.dtype == torch.float32
    params = [p for p in model.parameters()]
    grads = torch.autograd.grad(lp[valid].sum() + 0.1 * ent[valid].sum(), params)
    ref_lp, ref_ent = naive_sequence_logprobs(model, input_ids, attention_mask, 0.8)
    ref_grads = torch.autograd.grad(ref_lp[valid].sum() + 0.1 * ref_ent[valid].sum(), params)
    torch.testing.assert_close(lp[valid], ref_lp[valid])
    torch.testing.assert_close(ent[valid], ref_ent[valid])
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)
    head = model.get_output_embeddings()
    assert not head._forward_hooks and not head._forward_pre_hooks


def test_sequence_logprobs_left_padding_scores_like_the_unpadded_row():
    model = tiny_qwen2()
    input_ids, attention_mask = left_padded_batch()
    with torch.no_grad():
        padded = sequence_logprobs(model, input_ids, attention_mask)
        alone = sequence_logprobs(model, input_ids[:1, 2:], attention_mask[:1, 2:])
    torch.testing.assert_close(padded[0, 2:], alone[0])
