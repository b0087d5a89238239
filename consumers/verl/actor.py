"""The Ray actor verl creates as ``MessageQueue.remote(config, max_queue_size)``: trajbus's queue with the
resources verl's own asks for, so it is scheduled where verl's would be."""

import ray

from trajbus.consumers.verl.queue import DurableMessageQueue

MessageQueue = ray.remote(num_cpus=2, max_concurrency=20)(DurableMessageQueue)
