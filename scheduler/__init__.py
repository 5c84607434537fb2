"""Pure scheduling logic over integers: requests, KV blocks, admission policies. No tensors, no I/O."""

from scheduler.admission import AdmissionRule, InvalidRequestError
from scheduler.block_manager import BlockManager
from scheduler.config import POLICIES, SchedulerConfig
from scheduler.dlpm import DLPMPolicy
from scheduler.fcfs import FCFSPolicy
from scheduler.lpm import LPMPolicy
from scheduler.plan import CachedRequestData, NewRequestData, SchedulerOutput
from scheduler.policy import Policy
from scheduler.priority import PriorityPolicy
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import SamplingParams, StructuredOutput
from scheduler.scheduler import Scheduler
from scheduler.stats import SchedulerStats, TenantStats
from scheduler.vtc import VTCPolicy

__all__ = [
    "AdmissionRule",
    "BlockManager",
    "CachedRequestData",
    "DLPMPolicy",
    "FCFSPolicy",
    "InvalidRequestError",
    "LPMPolicy",
    "NewRequestData",
    "POLICIES",
    "Policy",
    "PriorityPolicy",
    "Request",
    "RequestStatus",
    "SamplingParams",
    "StructuredOutput",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "TenantStats",
    "VTCPolicy",
]
