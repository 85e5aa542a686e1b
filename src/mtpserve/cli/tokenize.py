"""`mtpserve tokenize`: a text's token ids, as llama.cpp's llama-tokenize gives them; vocabulary only, no weights.

With `--chat` the input is a JSON chat (a list of messages, or {"messages": [...], "tools": [...]}),
rendered with the model's chat template (or `--chat-template`) before tokenizing, as llama-server does.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..chat import ChatTemplate, ChatTemplateError
from ..tokenizer import Tokenizer


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tokenize", help="print the token ids of a text (loads only the vocabulary)")
    p.add_argument("text", nargs="?", help="the text (or use --file)")
    p.add_argument("-m", "--model", help="GGUF file (default: the default model)")
    p.add_argument("-f", "--file", help="read the text from this file ('-' = stdin)")
    p.add_argument("--no-parse-special", action="store_true", help="read control-token text as plain text")
    p.add_argument("--no-add-special", action="store_true", help="do not add BOS/EOS")
    p.add_argument("--show-pieces", action="store_true", help="print one 'id -> piece' line per token")
    p.add_argument("--chat", action="store_true", help="the input is a JSON chat; render it with the template")
    p.add_argument("--chat-template", metavar="FILE|NAME", help="override the model's chat template (e.g. chatml)")
    p.add_argument("--chat-template-kwargs", metavar="JSON", help="extra template variables, a JSON object")
    p.add_argument("--apply-template", action="store_true", help="with --chat: print the rendered prompt only")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..default_models import default_model_path

    if (args.text is None) == (args.file is None):
        raise ValueError("give the text either as an argument or with --file")
    # the bytes as they are, as llama-tokenize reads them (text mode would turn CRLF into LF)
    if args.file == "-":
        text = sys.stdin.buffer.read().decode("utf-8")
    elif args.file is not None:
        text = Path(args.file).read_bytes().decode("utf-8")
    else:
        text = args.text
    tokenizer = Tokenizer.from_gguf(args.model or default_model_path())
    if args.chat:
        text = render_chat(tokenizer, text, args.chat_template, args.chat_template_kwargs)
        if args.apply_template:
            print(text, end="")
            return 0
    elif args.chat_template or args.apply_template or args.chat_template_kwargs:
        raise ValueError("--chat-template, --chat-template-kwargs and --apply-template need --chat")
    ids = tokenizer.encode(text, add_special=not args.no_add_special, parse_special=not args.no_parse_special)
    if args.show_pieces:
        for i in ids:
            print(f"{i:7d} -> {json.dumps(tokenizer.token_to_piece(i), ensure_ascii=False)}")
    else:
        print(json.dumps(ids))
    return 0


def render_chat(tokenizer: Tokenizer, chat_json: str, template: str | None, kwargs_json: str | None) -> str:
    """The prompt llama-server would build for a chat request body's messages/tools."""
    try:
        chat = json.loads(chat_json)
        kwargs = json.loads(kwargs_json) if kwargs_json else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"the chat and --chat-template-kwargs must be JSON: {e}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object")
    body = chat if isinstance(chat, dict) else {"messages": chat}
    try:
        tmpl = ChatTemplate.for_tokenizer(tokenizer, template)
        return tmpl.apply(body.get("messages"), tools=body.get("tools"), chat_template_kwargs=kwargs).prompt
    except ChatTemplateError as e:
        raise ValueError(f"chat template: {e}") from None
