"""The S3 front: an S3-compatible endpoint on the node, so that code that reads
``s3://`` gets the cache by setting ``AWS_ENDPOINT_URL`` (docs/s3.md).

One more door onto the read path and the listings (single flight, tiers, peers,
pinned versions); it parses, checks the signature, maps errors and formats, and
holds no caching of its own. Rooms:

- :mod:`~chunkd.gateway.s3front.front`: the door (routes, listings);
- :mod:`~chunkd.gateway.s3front.conditions`: an object GET's conditions (RFC 9110, as S3
  applies them);
- :mod:`~chunkd.gateway.s3front.sigv4`: the AWS Signature Version 4 check (and the door to
  :mod:`~chunkd.gateway.s3front.sigv2`, Version 2, which boto3 presigns with by default);
- :mod:`~chunkd.gateway.s3front.requesttime`, :mod:`~chunkd.gateway.s3front.querystring`,
  :mod:`~chunkd.gateway.s3front.refusals`: what both signature checks share (a request's
  time, the query as signed and as served, bounded refusals);
- :mod:`~chunkd.gateway.s3front.keys`: the front's access keys;
- :mod:`~chunkd.gateway.s3front.xml`: the documents S3 answers with;
- :mod:`~chunkd.gateway.s3front.errors`: S3's error codes.
"""

from __future__ import annotations

from chunkd.gateway.s3front.front import S3Front, S3FrontRunner

__all__ = ["S3Front", "S3FrontRunner"]
