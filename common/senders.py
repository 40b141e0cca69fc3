"""Who may send each message type: the sender's broker user (`user_id`) against its role.

RabbitMQ refuses a publish whose `user_id` is not the publisher's login, so a message that
carries one says which broker user sent it; one without it is refused here. The broker's
permissions already keep each user to the exchanges it needs (deploy/rabbitmq/definitions.json),
but several senders share a queue: learners and the scheduler both write to fedmq.aggregator,
learners, the aggregator and the CLI to fedmq.scheduler. This table keeps each of them to its
own messages there:

    role        sends                                      users (settings)
    scheduler   job_create round_open round_close          FEDMQ_SCHEDULER_USERS
                train_task train_tasks eval_task
                ddp_launch ddp_stop
    aggregator  update_accepted updates_accepted           FEDMQ_AGGREGATOR_USERS
                round_closed job_failed ddp_stored
    learner     client_update group_update eval_report     FEDMQ_LEARNER_USERS
                client_failure heartbeat model_get client_state_get
                ddp_exit ddp_progress ddp_model
    cli         job_submit job_cancel status_request       FEDMQ_CLI_USERS
                model_get client_state_get

Learners of logical clients may share one broker user: the check says "a learner sent it",
not which. A site's learners are bound tighter: FEDMQ_SITE_USERS names the broker users that
serve each site, and an update, evaluation or failure for that site's client from any other
user is refused (check_site_sender): the learner that was not given a site's task cannot
speak for it, even with valid learner credentials.
"""

from __future__ import annotations

from collections.abc import Mapping

from fedmq.common.errors import ValidationError

SENDERS: dict[str, frozenset[str]] = {
    **dict.fromkeys(("job_create", "round_open", "round_close", "train_task", "train_tasks", "eval_task",
                     "ddp_launch", "ddp_stop"), frozenset({"scheduler"})),
    **dict.fromkeys(("update_accepted", "updates_accepted", "round_closed", "job_failed", "ddp_stored"),
                    frozenset({"aggregator"})),
    **dict.fromkeys(("client_update", "group_update", "eval_report", "client_failure", "heartbeat",
                     "ddp_exit", "ddp_progress", "ddp_model"), frozenset({"learner"})),
    **dict.fromkeys(("job_submit", "job_cancel", "status_request"), frozenset({"cli"})),
    # The CLI reads a model, and a logical client's kept state (Result.client_state: sealed if the
    # learners seal it); a site's state goes to learners only (its own, by check_site_sender).
    **dict.fromkeys(("model_get", "client_state_get"), frozenset({"learner", "cli"})),
}


def may_send(message_type: str, user_id: str | None, role_users: Mapping[str, frozenset[str]]) -> bool:
    """True if `user_id` holds a role that sends `message_type` (replies and events are not checked here)."""
    if not user_id:
        return False
    return any(user_id in role_users.get(role, frozenset()) for role in SENDERS.get(message_type, ()))


def check_sender(message_type: str, user_id: str | None, role_users: Mapping[str, frozenset[str]]) -> None:
    """ValidationError("sender") unless `user_id` may send `message_type`."""
    if may_send(message_type, user_id, role_users):
        return
    settings = ", ".join(f"FEDMQ_{role.upper()}_USERS" for role in sorted(SENDERS.get(message_type, ())))
    who = f"broker user {user_id!r}" if user_id else "a publisher that set no user_id"
    raise ValidationError(
        "sender", f"{message_type} from {who}: only the users in {settings or 'no setting'} send it"
    )


def check_site_sender(
    site: str | None, user_id: str | None, users_of_sites: Mapping[str, frozenset[str]]
) -> None:
    """ValidationError("site_sender") when `site` is bound to broker users and `user_id` is not one."""
    if site is None or site not in users_of_sites or (user_id and user_id in users_of_sites[site]):
        return
    who = f"broker user {user_id!r}" if user_id else "a publisher that set no user_id"
    raise ValidationError(
        "site_sender", f"site {site}'s client spoken for by {who}: FEDMQ_SITE_USERS gives site {site} "
        f"to {', '.join(sorted(users_of_sites[site]))} only"
    )
