"""Object storage: the S3 bucket (boto3), image encoding with its generation parameters, and
writing a job's image once; a video job's MP4, poster and preview (``video``, ``video_results``).

Place in the data flow: worker → **storage** → the status API's presigned URLs. Imports only the
``infra`` root.
"""
