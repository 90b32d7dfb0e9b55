"""The character tokenizer and the tiny policy folder: what env connectors and ``miles serve`` load."""
import subprocess
import sys

from miles_tinypolicy import char_tokenizer, write_policy

TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"


def test_one_token_per_character_newlines_and_spaces_included():
    tok = char_tokenizer("ab \n")
    ids = tok("a\n\nb a?", add_special_tokens=False)["input_ids"]
    # every listed character is its own token (a run of newlines too); an unlisted one is <pad>
    assert ids == [3, 6, 6, 4, 5, 3, tok.pad_token_id]
    assert tok.decode(ids[:-1]) == "a\n\nb a"
    assert (tok.eos_token_id, tok.bos_token_id) == (1, 2) and tok.chat_template is None


def test_without_bos_the_characters_start_at_two():
    tok = char_tokenizer("ab", bos=False)
    assert tok("ba", add_special_tokens=False)["input_ids"] == [3, 2]
    assert (len(tok), tok.eos_token_id, tok.bos_token_id, tok.bos_token) == (4, 1, None, None)


def test_the_policy_folder_is_seeded_and_loads_with_its_chat_template(tmp_path):
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    kw = dict(hidden=16, intermediate=32, context=64)
    a, b, c = (write_policy(tmp_path / name, "0123456789+=<>resu\n", TEMPLATE, seed=seed, **kw)
               for name, seed in (("a", 3), ("b", 3), ("c", 4)))
    weights = [(p / "model.safetensors").read_bytes() for p in (a, b, c)]
    assert weights[0] == weights[1] != weights[2]
    model = AutoModelForCausalLM.from_pretrained(a)
    tok = PreTrainedTokenizerFast.from_pretrained(a)
    assert model.config.vocab_size == len(tok) == 22 and model.config.max_position_embeddings == 64
    assert model.config.hidden_size == 16 and model.config.tie_word_embeddings
    ids = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=True, return_dict=False)
    assert tok.pad_token_id not in ids and tok.decode(ids) == "<user>1+2=\n"


def test_it_imports_and_builds_a_tokenizer_without_pytest():
    code = ("import sys; sys.modules['pytest'] = None; from miles_tinypolicy import char_tokenizer; "
            "assert len(char_tokenizer('xy')) == 5")
    subprocess.run([sys.executable, "-c", code], check=True)
