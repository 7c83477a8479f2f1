"""IAM: nested projects with quotas, and the API keys that act for them."""

from dsec.iam.store import IAM, KEY_PREFIX, KEY_ROLES, ROOT_PROJECT, ApiKeyInfo, Principal, Project, require_admin
from dsec.iam.quota import ProjectQuota, QuotaExceeded, Usage

__all__ = ["IAM", "KEY_PREFIX", "KEY_ROLES", "require_admin", "ROOT_PROJECT", "ApiKeyInfo", "Principal", "Project", "ProjectQuota", "QuotaExceeded",
           "Usage"]
