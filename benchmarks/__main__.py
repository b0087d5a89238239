"""`make bench`: run every benchmark in turn."""

from benchmarks import (agentic_bench, arena_bench, assembly_bench, codec_bench, convert_bench, export_bench,
                        gateway_bench, pacing_bench, tracing_bench, update_bench, verl_queue_bench)

if __name__ == "__main__":
    codec_bench.main()
    assembly_bench.main()
    agentic_bench.main(["--long"])  # all three workloads of issue 12
    convert_bench.main()
    gateway_bench.main([])
    arena_bench.main([])
    tracing_bench.main()
    pacing_bench.main()
    update_bench.main([])
    verl_queue_bench.main([])
    export_bench.main([])
