{{/* Names, labels, the merged pool settings and the shared environment. */}}

{{- define "renderfarm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "renderfarm.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains (include "renderfarm.name" .) .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "renderfarm.name" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "renderfarm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "renderfarm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "renderfarm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "renderfarm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "renderfarm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "renderfarm.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* "repository:tag" of an images.* entry; the tag defaults to the chart's appVersion. */}}
{{- define "renderfarm.image" -}}
{{- $img := .image -}}
{{- printf "%s:%s" $img.repository (default .root.Chart.AppVersion $img.tag | toString) -}}
{{- end -}}

{{/*
Deep merge for values: keys present in .over win, maps merge recursively. Unlike sprig's
merge/mergeOverwrite it keeps a pool's explicit 0, false or "" (e.g. minReplicas: 0).
Returns JSON.
*/}}
{{- define "renderfarm.deepMerge" -}}
{{- $out := dict -}}
{{- range $k, $v := .base -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- range $k, $v := .over -}}
{{- if and (kindIs "map" $v) (kindIs "map" (get $out $k)) -}}
{{- $_ := set $out $k (include "renderfarm.deepMerge" (dict "base" (get $out $k) "over" $v) | fromJson) -}}
{{- else -}}
{{- $_ := set $out $k $v -}}
{{- end -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/*
A pool with workerDefaults filled in and derived fields: deploymentName, queue, device, image,
grace (terminationGracePeriodSeconds). Call with (dict "root" $ "pool" $pool); returns JSON.
The pool name must be a DNS label: it names Kubernetes objects and the queue renderfarm.<name>.
*/}}
{{- define "renderfarm.pool" -}}
{{- $root := .root -}}
{{- $p := include "renderfarm.deepMerge" (dict "base" $root.Values.workerDefaults "over" .pool) | fromJson -}}
{{- if not $p.name -}}{{- fail "every pool needs a name" -}}{{- end -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $p.name) -}}
{{- fail (printf "pool name %q must be a DNS label (lowercase letters, digits and '-')" $p.name) -}}
{{- end -}}
{{- if gt (len $p.name) 40 -}}{{- fail (printf "pool name %q is longer than 40 characters" $p.name) -}}{{- end -}}
{{- if not $p.model -}}{{- fail (printf "pool %q needs a model" $p.name) -}}{{- end -}}
{{- if not (has $p.deviceClass (list "cpu" "cuda")) -}}
{{- fail (printf "pool %q: deviceClass must be cpu or cuda, not %q" $p.name $p.deviceClass) -}}
{{- end -}}
{{- $_ := set $p "deploymentName" (printf "%s-worker-%s" (include "renderfarm.fullname" $root | trunc 22 | trimSuffix "-") $p.name) -}}
{{- $_ := set $p "queue" (printf "renderfarm.%s" $p.name) -}}
{{- $_ := set $p "device" (default $p.deviceClass $p.device) -}}
{{- $imgKey := ternary "workerCuda" "workerCpu" (eq $p.deviceClass "cuda") -}}
{{- $img := include "renderfarm.deepMerge" (dict "base" (get $root.Values.images $imgKey) "over" (default dict $p.image)) | fromJson -}}
{{- $_ := set $p "imageRef" (include "renderfarm.image" (dict "root" $root "image" $img)) -}}
{{- $_ := set $p "imagePullPolicy" $img.pullPolicy -}}
{{- $longest := int $p.longestBatchSeconds -}}
{{- $grace := add $longest (int $p.shutdownMarginSeconds) -}}
{{- if not (kindIs "invalid" $p.terminationGracePeriodSeconds) -}}
{{- $grace = int $p.terminationGracePeriodSeconds -}}
{{- if lt $grace $longest -}}
{{- fail (printf "pool %q: terminationGracePeriodSeconds %d is shorter than longestBatchSeconds %d; scale-down would kill a running batch" $p.name $grace $longest) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $p "grace" $grace -}}
{{- $_ := set $p "triggerType" (default $root.Values.autoscaling.trigger $p.autoscaling.trigger) -}}
{{- toJson $p -}}
{{- end -}}

{{- define "renderfarm.poolLabels" -}}
app.kubernetes.io/component: worker
renderfarm.io/pool: {{ .name }}
{{- end -}}

{{/* "true" when the chart runs its own Redis (no external url or urlSecret), else "". */}}
{{- define "renderfarm.bundledRedis" -}}
{{- if and .Values.redis.bundled.enabled (not .Values.redis.url) (not .Values.redis.urlSecret.name) -}}true{{- end -}}
{{- end -}}

{{/* "true" when the bundled Redis is a Sentinel group, else "". */}}
{{- define "renderfarm.sentinelRedis" -}}
{{- if and (include "renderfarm.bundledRedis" .) .Values.redis.bundled.sentinel.enabled -}}true{{- end -}}
{{- end -}}

{{- define "renderfarm.redisSecretName" -}}
{{- default (printf "%s-redis" (include "renderfarm.fullname" .)) .Values.redis.bundled.auth.existingSecret -}}
{{- end -}}

{{/* The Redis URL; the bundled Redis's carries $(REDIS_PASSWORD), which Kubernetes expands from
the env entry of that name defined just before it (renderfarm.env). */}}
{{- define "renderfarm.redisUrl" -}}
{{- if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else if and .Values.redis.bundled.enabled .Values.redis.bundled.sentinel.enabled -}}
{{- $sentinels := list -}}
{{- range (include "renderfarm.redisPeers" . | splitList " ") -}}
{{- $sentinels = append $sentinels (printf "%s:26379" .) -}}
{{- end -}}
{{- printf "sentinel://:$(REDIS_PASSWORD)@%s/%s/0?sentinel_password=$(REDIS_PASSWORD)" (join "," $sentinels) .Values.redis.bundled.sentinel.masterName -}}
{{- else if .Values.redis.bundled.enabled -}}
{{- printf "redis://:$(REDIS_PASSWORD)@%s-redis:6379/0" (include "renderfarm.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The bundled Redis's headless Service (Sentinel mode): it gives each pod a DNS name. */}}
{{- define "renderfarm.redisHeadless" -}}
{{- printf "%s-redis-headless" (include "renderfarm.fullname" .) -}}
{{- end -}}

{{/* The DNS names of the Sentinel group's pods, space-separated, in ordinal order. */}}
{{- define "renderfarm.redisPeers" -}}
{{- $name := printf "%s-redis" (include "renderfarm.fullname" .) -}}
{{- $domain := printf "%s.%s.svc" (include "renderfarm.redisHeadless" .) .Release.Namespace -}}
{{- $peers := list -}}
{{- range $i := until (int .Values.redis.bundled.sentinel.replicas) -}}
{{- $peers = append $peers (printf "%s-%d.%s" $name $i $domain) -}}
{{- end -}}
{{- join " " $peers -}}
{{- end -}}

{{/* The bundled Redis's redis.conf: the broker and job-state store, durable (AOF) and never
evicting. requirepass comes from the Secret (on the command line, or in Sentinel mode appended by
the start script); protected mode stays on. */}}
{{- define "renderfarm.redisConf" -}}
{{- $r := .Values.redis.bundled -}}
dir /data
appendonly yes
appendfsync {{ $r.appendfsync }}
aof-use-rdb-preamble yes
auto-aof-rewrite-percentage 100
auto-aof-rewrite-min-size 64mb
save 900 1
maxmemory-policy noeviction
{{- with $r.maxmemory }}
maxmemory {{ . }}
{{- end }}
protected-mode yes
tcp-keepalive 60
{{- end -}}

{{/* The env entry REDIS_PASSWORD from the bundled Redis's Secret. */}}
{{- define "renderfarm.redisPasswordEnv" -}}
- name: REDIS_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ include "renderfarm.redisSecretName" . }}
      key: {{ .Values.redis.bundled.auth.passwordKey }}
{{- end -}}

{{- define "renderfarm.s3SecretName" -}}
{{- if .Values.s3.existingSecret -}}
{{- .Values.s3.existingSecret -}}
{{- else if .Values.s3.accessKeyId -}}
{{- printf "%s-s3" (include "renderfarm.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "renderfarm.apiUrl" -}}
{{- printf "http://%s-api.%s.svc:%d" (include "renderfarm.fullname" .) .Release.Namespace (int .Values.api.service.port) -}}
{{- end -}}

{{/* envFrom + env shared by the API, the workers and the catalog job. */}}
{{- define "renderfarm.envFrom" -}}
- configMapRef:
    name: {{ include "renderfarm.fullname" . }}-env
{{- end -}}

{{- define "renderfarm.env" -}}
{{- if .Values.redis.urlSecret.name }}
- name: RENDERFARM_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.redis.urlSecret.name }}
      key: {{ .Values.redis.urlSecret.key }}
{{- else }}
{{- $url := include "renderfarm.redisUrl" . -}}
{{- if not $url -}}{{- fail "set redis.url, redis.urlSecret.name, or redis.bundled.enabled=true" -}}{{- end }}
{{- if include "renderfarm.bundledRedis" . }}
{{ include "renderfarm.redisPasswordEnv" . }}
{{- end }}
- name: RENDERFARM_REDIS_URL
  value: {{ $url | quote }}
{{- end }}
{{- with .Values.redis.brokerShards.secretName }}
- name: RENDERFARM_BROKERS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.redis.brokerShards.key }}
{{- end }}
{{- with (include "renderfarm.s3SecretName" .) }}
- name: AWS_ACCESS_KEY_ID
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.s3.accessKeyIdKey }}
- name: AWS_SECRET_ACCESS_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.s3.secretAccessKeyKey }}
{{- end }}
{{- end -}}

{{/* "true" when the API requires a tenant key (config.RENDERFARM_AUTH_REQUIRED wins over
auth.required), else "". */}}
{{- define "renderfarm.authRequired" -}}
{{- $v := .Values.auth.required -}}
{{- if hasKey .Values.config "RENDERFARM_AUTH_REQUIRED" -}}
{{- $v = index .Values.config "RENDERFARM_AUTH_REQUIRED" -}}
{{- end -}}
{{- if has (lower (toString $v)) (list "true" "1" "yes" "on") -}}true{{- end -}}
{{- end -}}

{{/* The Secret holding the metrics scrape token (RENDERFARM_METRICS_TOKEN): the user's
metrics.tokenSecret.name, else the chart's own when auth is required, else "" (none). */}}
{{- define "renderfarm.scrapeSecretName" -}}
{{- if .Values.metrics.tokenSecret.name -}}
{{- .Values.metrics.tokenSecret.name -}}
{{- else if include "renderfarm.authRequired" . -}}
{{- printf "%s-scrape" (include "renderfarm.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* The chart's KEDA TriggerAuthentication for the metrics-api trigger: the user's
autoscaling.metricsApi.authenticationRef wins; else the chart's own when auth is required. */}}
{{- define "renderfarm.queuesAuthRef" -}}
{{- if .Values.autoscaling.metricsApi.authenticationRef -}}
{{- .Values.autoscaling.metricsApi.authenticationRef -}}
{{- else if include "renderfarm.authRequired" . -}}
{{- printf "%s-queues" (include "renderfarm.fullname" .) -}}
{{- end -}}
{{- end -}}
