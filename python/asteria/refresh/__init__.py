"""The REFRESH room: the op table (``ops``), the executor seam (``engine``), the executors
(``inline_torch``; libasteria's pool in ``host_pool``;
replicated blocks in ``replicated``) and the one place that picks an executor (``select``)."""
