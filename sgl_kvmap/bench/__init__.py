"""The prefix-reuse benchmark behind ``sgl-kvmap bench``: sessions replayed from a request trace
across two engines of one family, a routing policy choosing the model of each request, and each
swapped request's prefix served by re-prefill or by translation. ``workload`` turns a trace into
sessions of prompts (and what an oracle cache could reuse), ``routing`` picks each turn's model,
``records`` holds what one request's replay measured."""
