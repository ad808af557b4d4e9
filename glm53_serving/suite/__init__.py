"""The isolation suite: multi-tenant workloads an adversary would send, against a real deployment,
judged by oracles that each fail on their own.

    python -m glm53_serving.suite --profile ci                     # single, then PD, launched here
    python -m glm53_serving.suite --profile thorough --topology pd  # an hour, before a release
    python -m glm53_serving.suite --url http://gw:8080 --keys keys.json [--worker decode-0=http://... --assertion-key k --deployment d]
    python -m glm53_serving.suite --replay suite-out/failure-1.json --topology pd
    python -m glm53_serving.suite --profile ci --reintroduce-incident   # must report leaks

- workload.py: Hypothesis draws a workload: several tenants, each marking its prompts with its own
  token sequence; prompt lengths from a few tokens to exactly the limit and over it; prefixes
  shared within and across tenants, page-aligned or not; streaming or not; clients that leave
  before the first token or mid-stream; more KV than the pools hold, so that requests queue and
  pages are reused. One workload is sent at once, as one interleaving.
- oracles.py: differential (every 200 equals the same request served alone, and PD equals the
  single server), canary (no response carries another tenant's marker or name), status (each
  request gets the status the admission formula predicts, within a bound), drain (afterwards no
  request is held and, after a cache flush, no page is owned and every page is free).
- client.py: the suite's side of a deployment (Target): a call as a client makes it, the guards'
  view of the pools, a call's solo run; faults.py: faults injected into PD, each confirmed.
- __main__.py: launches the topology (or takes --url), runs the profile, saves a failing
  workload as JSON (and in Hypothesis' database) for --replay, and ends with one summary line:
  `suite: requests=N tenants=T interleavings=I faults=F/C confirmed leaks=L oracles_fired=K`.
"""
