"""GPT-2's byte-to-unicode table: how a byte-level BPE vocabulary writes each
byte as a character (the tokenizers, the GGUF and HF readers share it)."""


def _gpt2_byte_strings() -> tuple[str, ...]:
    """GPT-2's bytes_to_unicode: printable Latin-1 bytes as themselves, the others
    as U+0100 onwards in byte order."""
    keep = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
            + list(range(ord("®"), ord("ÿ") + 1)))
    table = {}
    extra = 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return tuple(table[b] for b in range(256))


# byte b of a byte-level BPE vocabulary's token text (a GGUF's gpt2-type tokens)
GPT2_BYTE_STRINGS = _gpt2_byte_strings()
