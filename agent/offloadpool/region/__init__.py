"""Node-side region engine: plan, provision, populate, keep and release pool memory (stdlib only).

Public API (docs/node-engine.md)::

    from offloadpool.region.request import PoolRequest            # what one node must hold
    from offloadpool.region.lifecycle.provision import provision  # make it Ready (or keep, rebuild)
    from offloadpool.region.lifecycle.status import pool_state, list_pools
    from offloadpool.region.lifecycle.release import release      # give it back (lease permitting)
    from offloadpool.region.errors import CapacityError, RegionError, RequestError, LeaseHeld

Four rooms, one concern each (docs/code-layout.md): ``memory`` (media, huge pages, mounts,
NUMA, cgroup limits, the parallel pre-fault), ``files`` (places, names opened beneath a
descriptor, the segment plan, manifest, record, journal, layout files, migration), ``holding``
(the lease and its sidecar, who maps or opens a pool, CSI publications, shares) and
``lifecycle`` (provision, scrub, teardown, release, status). ``request``, ``vocabulary`` and
``errors`` are what every room shares; ``files.manifest`` and ``holding.lease`` are the
contracts with the pinning helper.
"""
