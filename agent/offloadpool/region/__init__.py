"""Node-side region engine: plan, provision, populate, keep and release pool memory (stdlib only).

Public API (docs/node-engine.md)::

    from offloadpool.region.request import PoolRequest       # what one node must hold
    from offloadpool.region.provision import provision       # make it Ready (or keep, finish, rebuild)
    from offloadpool.region.status import pool_state, list_pools
    from offloadpool.region.release import release           # give it back (lease permitting)
    from offloadpool.region.errors import CapacityError, RegionError, RequestError, LeaseHeld

Modules, one concept each: ``planner`` (segment plan), ``capacity`` (fits?), ``hugepages``
(kernel pools; ``hugepage_intent``: their changes survive a kill), ``mounts`` (mount(2)),
``layout_files`` (segment/lease/compat files),
``populate`` + ``vm`` + ``journal`` (parallel resumable pre-fault), ``numa`` (mbind),
``record`` (the node's state.json), ``teardown``, ``holders`` (who maps, opens or leases a
pool, in any mount namespace); ``manifest`` and ``lease`` are the contracts shared with the
pinning helper.
"""
