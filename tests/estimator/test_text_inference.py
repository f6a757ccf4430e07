"""transform()'s text recipe on one executor's documents, without Spark: documents of similar
length share a batch and every value returns to its own document's row."""
import pytest
import text_fns
import torch

from sparkring.data.text import Encoder
from sparkring.estimator import text_inference
from sparkring.estimator.text_inference import TextInference

pytest.importorskip("transformers")


def _widths_seen(monkeypatch):
    """The padded width of every batch the recipe builds."""
    widths = []

    def padded(*args, **kwargs):
        ids, mask = pad(*args, **kwargs)
        widths.append(ids.shape[1])
        return ids, mask
    pad = text_inference._padded  # noqa: SLF001
    monkeypatch.setattr(text_inference, "_padded", padded)
    return widths


@pytest.mark.parametrize("mode", ["score", "embed", "generate"])
def test_documents_of_similar_length_share_a_batch_and_each_value_keeps_its_row(mode, monkeypatch):
    tok = text_fns.tokenizer()
    model = text_fns.llama(tok.get_vocab_size()).eval()
    encoder = Encoder(tok)
    eos, pad = encoder.special_ids()
    recipe = TextInference(mode, eos, pad, max_length=32, generation={"max_new_tokens": 4})
    short, long = "the cat", "the big cat sat on the red mat under the small tree ."
    texts = [short, long, short + " ran", long + " the dog", short, long]
    alone = [recipe.run(model, encoder, torch.device("cpu"), [text])[0] for text in texts]

    widths = _widths_seen(monkeypatch)
    together = recipe.run(model, encoder, torch.device("cpu"), texts, batch_size=3)

    lengths = sorted(len(ids) for ids in recipe._tokens(encoder, texts))  # noqa: SLF001 (the recipe's own token ids)
    assert widths == [lengths[2], lengths[5]] and lengths[2] < lengths[5]  # the short three padded to their longest
    if mode == "generate":
        assert together == alone
    elif mode == "score":
        assert [v["loss"] for v in together] == pytest.approx([v["loss"] for v in alone], rel=1e-4)
    else:
        assert torch.allclose(torch.tensor(together), torch.tensor(alone), atol=1e-4)
