"""The reward (and tool) worker process's main loop. Kept free of heavy imports (no JAX): a spawned worker
imports only this module and the reward functions it is asked to run."""

from __future__ import annotations

import traceback


def worker_main(conn) -> None:
    from rewards.registry import call, resolve

    conn.send(("ready", None))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        try:
            if task[0] == "tool":  # one tool call: ("tool", spec, kwargs, arguments)
                from posttrain.tools import call_tool

                out = call_tool(task[1], task[3], task[2])
            else:
                fn, adapter, kwargs, prompts, completions, columns = task
                out = call(resolve(fn, adapter), prompts, completions, kwargs, columns)
            conn.send(("ok", out))
        except BaseException as e:  # noqa: BLE001 - user code may raise anything
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc(limit=4)))
