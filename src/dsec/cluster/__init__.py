"""Cluster mode: edges served over HTTP (edge_service, edge_client) and placed on Ray nodes
(ray_cluster); apiserver replicas discover them (discovery). docs/decisions.md, D32."""
