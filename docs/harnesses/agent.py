"""A minimal agent: asks the model, runs the shell commands it calls, sends back their output, until it answers."""

import json
import os
import subprocess
import sys
import urllib.request

URL = os.environ["OPENAI_BASE_URL"] + "/chat/completions"
KEY = os.environ["OPENAI_API_KEY"]
MODEL = os.environ.get("POLAR_MODEL", "policy")
TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a shell command in the working directory",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]


def ask(messages):
    body = json.dumps({"model": MODEL, "messages": messages, "tools": TOOLS}).encode()
    headers = {"content-type": "application/json", "authorization": f"Bearer {KEY}"}
    with urllib.request.urlopen(urllib.request.Request(URL, body, headers), timeout=600) as reply:
        return json.load(reply)["choices"][0]["message"]


messages = [{"role": "user", "content": sys.argv[1]}]
for _ in range(20):
    message = ask(messages)
    messages.append(message)
    if not message.get("tool_calls"):
        print(message.get("content"))
        break
    for call in message["tool_calls"]:
        command = json.loads(call["function"]["arguments"])["command"]
        done = subprocess.run(command, shell=True, capture_output=True, text=True)
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": done.stdout + done.stderr})
