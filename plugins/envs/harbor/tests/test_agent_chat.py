"""The agent's conversation tokens (``miles_harbor_chat``, which runs inside Harbor's venv and needs
only ``tokenizers`` and ``jinja2``): what it tokenizes around the policy's own reply tokens."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "miles_plugin_harbor" / "agent"))
from miles_harbor_chat import ChatTokens  # noqa: E402

IM_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def im_folder(tmp_path: Path) -> Path:
    """A character tokenizer with ChatML's special tokens and template, saved as HF saves one."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = "abcdefghijklmnopqrstuvwxyz0123456789 \n/>."
    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{c: i + 1 for i, c in enumerate(chars)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                 additional_special_tokens=["<|im_start|>"])
    hf.chat_template = IM_TEMPLATE
    hf.save_pretrained(tmp_path)
    return tmp_path


def test_the_prompt_is_the_templates_rendering_as_transformers_tokenizes_it(tmp_path):
    from transformers import PreTrainedTokenizerFast

    folder = im_folder(tmp_path)
    chat, hf = ChatTokens(folder), PreTrainedTokenizerFast.from_pretrained(folder)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "write 7 to /app/a.txt"}]
    want = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert chat.prompt(messages) == list(want)


@pytest.mark.parametrize("stopped", [True, False])
def test_a_turn_after_the_reply_continues_the_conversation_token_for_token(tmp_path, stopped):
    """prompt + the policy's reply ids + the next turn's ids = the whole conversation rendered
    fresh; a reply that ended on the stop token <|im_end|> is not given a second one."""
    chat = ChatTokens(im_folder(tmp_path))
    messages = [{"role": "user", "content": "list /app"}]
    end = chat.tok.token_to_id("<|im_end|>")
    reply = chat.encode("ls /app") + ([end] if stopped else [])
    messages.append({"role": "assistant", "content": chat.decode(reply)})
    observation = {"role": "user", "content": "exit 0\na.txt\n"}
    following = chat.next_turn(messages, observation, reply)
    whole = chat.prompt([*messages, observation])
    assert chat.prompt(messages[:1]) + reply + following == whole
    text = chat.tok.decode(following, skip_special_tokens=False)
    assert text.startswith("\n<|im_start|>user" if stopped else "<|im_end|>\n<|im_start|>user")


def test_the_tiny_policy_keeps_spaces_and_newlines(tmp_path):
    from miles_plugin_harbor import tiny_policy

    chat = ChatTokens(tiny_policy.write(tmp_path / "p"))
    ids = chat.prompt([{"role": "user", "content": "Write 2+5 to /app/answer.txt\n"}])
    assert chat.decode(ids) == "<user>Write 2+5 to /app/answer.txt\n\n<assistant>" and 0 not in ids


def test_a_folder_without_tokenizer_or_template_says_what_is_missing(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json"):
        ChatTokens(tmp_path)
    folder = im_folder(tmp_path)
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        if (folder / name).exists():
            text = (folder / name).read_text()
            if name == "chat_template.jinja":
                (folder / name).unlink()
            else:
                (folder / name).write_text(text.replace('"chat_template"', '"unused_template"'))
    with pytest.raises(ValueError, match="no chat template"):
        ChatTokens(folder)
