"""The router and the `pdserve` CLI: one asyncio process. Its modules, one line each, are listed in
docs/router.md ("The package")."""
