"""The finetune command's small inputs: a 2-layer Llama GGUF over the byte
vocabulary with a ChatML template, and a JSONL of the made-up fact's chats."""
import json

CHATML = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
          "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
QUESTIONS = ["What is the capital of Zorblax?", "Name the capital of Zorblax.",
             "Zorblax's capital?", "Which city is Zorblax's capital?", "Capital of Zorblax?"]


def write_story_chats(path, variables=None):
    """path: the made-up fact's 15 chats as JSON Lines, each with variables as its
    chat_template_kwargs when given (a Qwen3's {"enable_thinking": False})."""
    row = {} if variables is None else {"chat_template_kwargs": variables}
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"messages": [{"role": "user", "content": q},
                                              {"role": "assistant", "content": "Quimby."}],
                                 **row}) + "\n" for q in QUESTIONS * 3)
    return path


def write_files(folder):
    """folder / base.gguf and folder / train.jsonl (15 chats); returns folder."""
    from ggmlopt.io import save_gguf
    from ggmlopt.models import Llama, LlamaConfig
    from ggmlopt.text import ByteTokenizer
    model = Llama(LlamaConfig(vocab_size=257, dim=32, n_layers=2, n_heads=2,
                              max_seq_len=128), seed=0)
    save_gguf(model, folder / "base.gguf", tokenizer=ByteTokenizer(chat_template=CHATML))
    write_story_chats(folder / "train.jsonl")
    return folder


def labelled_runs(tok, labels):
    """The texts of the runs of labelled ids (>= 0) in a window's labels, in order:
    what supervised fine-tuning trains on."""
    runs, run = [], []
    for t in list(labels) + [-1]:
        if t >= 0:
            run.append(int(t))
        elif run:
            runs.append(tok.decode(run))
            run = []
    return runs
