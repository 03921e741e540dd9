"""The tiers room: where optimizer state lives. ``plan`` decides a tier for every piece of state
from the budgets (the only reader of ``device_budget_bytes`` and ``host_budget_bytes``);
``residency`` keeps the roots and eigenbases that live off the device (host, pinned, UVM, NVMe
blocks) and stages them through the device ring for each step."""
