"""Multi-call LLM apps, each runnable in two modes against the same OpenAI-compatible server:

* ``run_parrot(client, model, cfg, rtt_ms)``: the app as a Parrot graph (semantic variables, calls
  submitted up front, constant prefixes shared);
* ``run_baseline(client, model, cfg, rtt_ms)``: the same prompts as plain chat completions driven
  from the client, the way a LangChain-style app does it.

``client`` is an ``httpx.AsyncClient`` whose ``base_url`` ends in ``/v1``; each module's ``Config``
holds the app's sizes. Both return a ``Result``.
"""

from benchmarks.workloads import chain, map_reduce, multi_agent, shared_prompt
from benchmarks.workloads.result import Result

WORKLOADS = {
    "map_reduce": map_reduce,
    "chain": chain,
    "multi_agent": multi_agent,
    "shared_prompt": shared_prompt,
}

__all__ = ["WORKLOADS", "Result"]
