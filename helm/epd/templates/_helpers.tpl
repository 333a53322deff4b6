{{/*
Names, labels, and the EPD_* rendering of `settings:`.

Why one renderer: `settings:` is the settings model (controlplane/settings.py) and every leaf of it must
reach the pods as the variable that model reads (EPD_ + the path in upper case, nested with "__"), with
dicts and lists as JSON. The control plane reads them all; each pool's worker group carries its own pool's.
*/}}

{{- define "epd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* 40 characters at most: KubeRay appends "-head-svc" and "-<group>-worker-<hash>" to the cluster name. */}}
{{- define "epd.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "epd.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "epd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: epd
{{- end -}}

{{- define "epd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "epd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "epd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) -}}
{{- end -}}

{{- define "epd.rayClusterName" -}}{{ include "epd.fullname" . }}{{- end -}}
{{- define "epd.authSecretName" -}}
{{- default (printf "%s-auth" (include "epd.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}
{{/* "true" when /metrics and /dashboard sit behind an ops token held in the auth Secret, else "". */}}
{{- define "epd.opsToken" -}}
{{- if .Values.auth.existingSecret -}}
{{- if .Values.auth.existingSecretKeys.opsToken -}}true{{- end -}}
{{- else if or .Values.auth.opsToken .Values.auth.generateOpsToken -}}true{{- end -}}
{{- end -}}
{{/* The ops token's key in the auth Secret: existingSecretKeys.opsToken, "ops-token" in a generated one. */}}
{{- define "epd.opsTokenKey" -}}{{ .Values.auth.existingSecretKeys.opsToken | default "ops-token" }}{{- end -}}
{{- define "epd.redisName" -}}{{ include "epd.fullname" . }}-redis{{- end -}}
{{/* Ray token auth (auth.rayToken.enabled; on when a release made by an older chart lacks the key). */}}
{{- define "epd.rayToken" -}}
{{- if dig "rayToken" "enabled" true .Values.auth -}}true{{- end -}}
{{- end -}}
{{/* "true" when the chart generates the Ray token (on, and no existingSecret). */}}
{{- define "epd.rayTokenGenerated" -}}
{{- if and (include "epd.rayToken" .) (not (dig "rayToken" "existingSecret" "" .Values.auth)) -}}true{{- end -}}
{{- end -}}
{{- define "epd.rayTokenSecretName" -}}
{{- default (printf "%s-ray-token" (include "epd.fullname" .)) (dig "rayToken" "existingSecret" "" .Values.auth) -}}
{{- end -}}
{{/* RAY_AUTH_MODE and RAY_AUTH_TOKEN for every container that talks to the Ray cluster; nothing when off. The
key is KubeRay's (authOptions.secretName expects auth_token too). */}}
{{- define "epd.rayAuthEnv" -}}
{{- if include "epd.rayToken" . }}
- {name: RAY_AUTH_MODE, value: token}
- name: RAY_AUTH_TOKEN
  valueFrom: {secretKeyRef: {name: {{ include "epd.rayTokenSecretName" . }}, key: auth_token}}
{{- end }}
{{- end -}}

{{- define "epd.redisSecretName" -}}
{{- default (include "epd.redisName" .) .Values.redis.auth.existingSecret -}}
{{- end -}}

{{/* The pools that run in this mode: colocated runs the decode pool only (its workers run whole requests). */}}
{{- define "epd.pools" -}}
{{- if eq (.Values.settings.mode | default "disaggregated") "colocated" -}}
["decode"]
{{- else -}}
["encode","prefill","decode"]
{{- end -}}
{{- end -}}

{{/* The Ray custom resource one replica of pool `.` needs; each worker group's pods advertise it. */}}
{{- define "epd.poolResource" -}}epd-{{ . }}{{- end -}}

{{/*
One pool's settings as the control plane must see them (JSON): the values' settings.<pool> with the pool's
custom Ray resource added to ray_resources, so each replica lands on its own worker group. In colocated
mode encode and prefill keep no replica count (the settings model refuses one there).
Args: dict "root" $ "pool" NAME
*/}}
{{- define "epd.poolSettings" -}}
{{- $pool := deepCopy (get .root.Values.settings .pool | default dict) -}}
{{- $res := merge (deepCopy ($pool.ray_resources | default dict)) (dict (include "epd.poolResource" .pool) 1) -}}
{{- $_ := set $pool "ray_resources" $res -}}
{{- if and (eq (.root.Values.settings.mode | default "disaggregated") "colocated") (ne .pool "decode") -}}
{{- $_ := unset $pool "replicas" -}}
{{- end -}}
{{- toJson $pool -}}
{{- end -}}

{{/* A scalar as an environment value: strings as they are, everything else as JSON (no 1e+08 floats). */}}
{{- define "epd.envValue" -}}
{{- if kindIs "string" . -}}{{ . }}{{- else -}}{{ toJson . }}{{- end -}}
{{- end -}}

{{/*
EPD_* variables for a settings subtree, sorted by name. Maps recurse only where the settings model nests a
model (the sections and `engine`); any other map (ray_resources) or list is one JSON value.
tests/helm checks this list against the model. Args: dict "prefix" "EPD" "values" MAP
*/}}
{{- define "epd.settingsEnv" -}}
{{- $nested := list "encode" "prefill" "decode" "transfer" "scheduler" "api" "redis" "ray" "observability" "engine" -}}
{{- $sep := ternary "_" "__" (eq .prefix "EPD") -}}
{{- range $key := keys .values | sortAlpha }}
{{- $v := get $.values $key }}
{{- $name := printf "%s%s%s" $.prefix $sep (upper $key) }}
{{- if and (kindIs "map" $v) (has $key $nested) }}
{{- include "epd.settingsEnv" (dict "prefix" $name "values" $v) }}
{{- else if not (kindIs "invalid" $v) }}
- name: {{ $name }}
  value: {{ include "epd.envValue" $v | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/*
Every EPD_* variable of `settings:` as the control plane reads them (pools with their Ray resource), except
the replica counts: those reach it through the replicas file (epd.replicaCounts), so that scaling a pool
changes no variable and restarts no pod.
*/}}
{{- define "epd.controlPlaneSettingsEnv" -}}
{{- $s := deepCopy .Values.settings -}}
{{- range $p := list "encode" "prefill" "decode" }}
{{- $_ := set $s $p (omit (include "epd.poolSettings" (dict "root" $ "pool" $p) | fromJson) "replicas") }}
{{- end }}
{{- include "epd.settingsEnv" (dict "prefix" "EPD" "values" $s) }}
{{- end -}}

{{/*
The replicas file (controlplane/replicas_file.py): each running pool's replica count as JSON, the same count
its worker group runs as pods. The control plane reads it at start and applies a change while it serves.
*/}}
{{- define "epd.replicaCounts" -}}
{{- $counts := dict -}}
{{- range $p := include "epd.pools" . | fromJsonArray }}
{{- $s := include "epd.poolSettings" (dict "root" $ "pool" $p) | fromJson }}
{{- $_ := set $counts $p (int64 $s.replicas) }}
{{- end }}
{{- toJson $counts -}}
{{- end -}}
{{- define "epd.replicasConfigMap" -}}{{ include "epd.fullname" . }}-replicas{{- end -}}
{{- define "epd.replicasDir" -}}/etc/epd/replicas{{- end -}}

{{/* Volumes every epd pod shares: the model folder (when given) and the mTLS material (when given). */}}
{{- define "epd.sharedVolumes" -}}
- name: cache
  emptyDir: {}
{{- with .Values.modelVolume.volume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- if .Values.auth.mtls.secretName }}
- name: mtls
  secret:
    secretName: {{ .Values.auth.mtls.secretName }}
    defaultMode: 0440  # the group (podSecurityContext.fsGroup) reads it: epd runs as uid 1000, not root
{{- end }}
{{- end -}}

{{- define "epd.sharedVolumeMounts" -}}
- name: cache
  mountPath: /var/cache/epd
{{- if .Values.modelVolume.volume }}
- name: model
  mountPath: {{ .Values.modelVolume.mountPath }}
  readOnly: true
{{- end }}
{{- if .Values.auth.mtls.secretName }}
- name: mtls
  mountPath: {{ .Values.auth.mtls.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
The control plane's startup probe: controlPlane.startupProbe, with failureThreshold raised where needed so
the probe outlasts the first start. `epd serve` opens the API after starting the pools one after another,
each allowed settings.ray.replica_start_timeout_s, so a probe shorter than that would kill a start that
is still within its time. A pool that runs replicas counts one start (its replicas start together), or
pools.<pool>.maxReplicas starts where they share a GPU (they start one after another). Never the replica
count itself: the probe is part of the pod, so a count changed by helm upgrade would restart it, and every
pool with it. Only a pool going to or from 0 replicas changes the probe.
*/}}
{{- define "epd.startupProbe" -}}
{{- $probe := deepCopy .Values.controlPlane.startupProbe -}}
{{- $period := int64 ($probe.periodSeconds | default 10) -}}
{{- $timeout := int64 ((.Values.settings.ray | default dict).replica_start_timeout_s | default 180) -}}
{{- $starting := 0 -}}
{{- range $p := include "epd.pools" . | fromJsonArray -}}
{{- $ps := get $.Values.settings $p | default dict -}}
{{- if gt (int64 ($ps.replicas | default 0)) 0 -}}
{{- $gpus := float64 ($ps.num_gpus | default 0) -}}
{{- $cuda := hasPrefix "cuda" (toString (($ps.engine | default dict).device | default "cpu")) -}}
{{- if or (and (gt $gpus 0.0) (lt $gpus 1.0)) (and (eq $gpus 0.0) $cuda) -}}
{{- $starting = add $starting (int64 (get $.Values.pools $p).maxReplicas) -}}{{/* sharing a GPU: one after another */}}
{{- else -}}
{{- $starting = add1 $starting -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $need := add (div (add (mul $starting $timeout) $period -1) $period) 6 -}}
{{- if lt (int64 ($probe.failureThreshold | default 3)) $need -}}
{{- $_ := set $probe "failureThreshold" $need -}}
{{- end -}}
{{- toYaml $probe -}}
{{- end -}}

{{/* Checks the schema cannot express (they cross fields); each message names the values to change. */}}
{{- define "epd.validate" -}}
{{- $s := .Values.settings -}}
{{- if include "epd.rayToken" . -}}
{{- $envs := dict "controlPlane.extraEnv" (.Values.controlPlane.extraEnv | default list) -}}
{{- range $p, $g := .Values.pools -}}{{- $_ := set $envs (printf "pools.%s.extraEnv" $p) ($g.extraEnv | default list) -}}{{- end -}}
{{- range $where, $env := $envs -}}
{{- range $e := $env -}}
{{- if hasPrefix "RAY_AUTH_" ($e.name | default "") -}}
{{- fail (printf "%s sets %s, which the chart sets itself while auth.rayToken.enabled is true (from the Secret %s): remove it, or set auth.rayToken.existingSecret to the Secret you meant" $where $e.name (include "epd.rayTokenSecretName" $)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $pe := ($s.prefill.engine | default dict) -}}
{{- $de := ($s.decode.engine | default dict) -}}
{{- if ne (toString ($pe.block_size | default 16)) (toString ($de.block_size | default 16)) -}}
{{- fail (printf "settings.prefill.engine.block_size (%v) and settings.decode.engine.block_size (%v) must match: KV blocks move between them as they are" ($pe.block_size | default 16) ($de.block_size | default 16)) -}}
{{- end -}}
{{- if and (hasPrefix "fp32" ($s.transfer.codec_policy | default "bf16")) (or (eq ($pe.dtype | default "float32") "bfloat16") (eq ($de.dtype | default "float32") "bfloat16")) -}}
{{- fail "settings.transfer.codec_policy fp32 needs float32 engines: use bf16 with bfloat16 engines" -}}
{{- end -}}
{{- range $p := include "epd.pools" . | fromJsonArray -}}
{{- $n := int64 ((get $s $p).replicas | default 0) -}}
{{- $g := get $.Values.pools $p -}}
{{- if gt (int64 $g.minReplicas) $n -}}
{{- fail (printf "settings.%s.replicas (%d) is below pools.%s.minReplicas (%d): lower minReplicas too" $p $n $p (int64 $g.minReplicas)) -}}
{{- end -}}
{{- if gt $n (int64 $g.maxReplicas) -}}
{{- fail (printf "settings.%s.replicas (%d) is above pools.%s.maxReplicas (%d): raise maxReplicas too" $p $n $p (int64 $g.maxReplicas)) -}}
{{- end -}}
{{- end -}}
{{- $pools := include "epd.pools" . | fromJsonArray -}}
{{- range $p := $pools -}}
{{- $ps := get $s $p | default dict -}}
{{- if kindIs "invalid" $ps.replicas -}}
{{- fail (printf "settings.%s.replicas is null: set it (0 or more); it is both the pool's target and its worker group's pod count" $p) -}}
{{- end -}}
{{- if and (ne $p "encode") (lt (int64 $ps.replicas) 1) -}}
{{- fail (printf "settings.%s.replicas is 0: the %s pool needs a replica to serve anything (set 1 or more)" $p $p) -}}
{{- end -}}
{{- $g := get $.Values.pools $p -}}
{{- $start := $g.rayStartParams | default dict -}}
{{- $gpus := 0.0 -}}
{{- $gpuFrom := "the GPUs in its limits (keys ending in gpu)" -}}
{{- if hasKey $start "num-gpus" -}}
{{- $gpus = float64 (index $start "num-gpus") -}}
{{- $gpuFrom = "its rayStartParams num-gpus" -}}
{{- else -}}
{{- range $name, $n := ($g.resources.limits | default dict) -}}
{{- if hasSuffix "gpu" $name -}}{{- $gpus = addf $gpus (float64 $n) -}}{{- end -}}
{{- end -}}
{{- end -}}
{{- if gt (float64 ($ps.num_gpus | default 0)) $gpus -}}
{{- fail (printf "settings.%s.num_gpus (%v) is more than one %s pod offers Ray (%v, %s): the replica would never be placed; give pools.%s.resources a GPU (or rayStartParams num-gpus) or lower num_gpus" $p $ps.num_gpus $p $gpus $gpuFrom $p) -}}
{{- end -}}
{{- $cpu := "" -}}
{{- $cores := 0.0 -}}
{{- if hasKey $start "num-cpus" -}}
{{- $cpu = printf "rayStartParams num-cpus %v" (index $start "num-cpus") -}}
{{- $cores = float64 (index $start "num-cpus") -}}
{{- else if ($g.resources.limits | default dict).cpu -}}
{{- $limit := toString ($g.resources.limits | default dict).cpu -}}
{{- $cpu = printf "CPU limit %s" $limit -}}
{{- $cores = ceil (ternary (divf (trimSuffix "m" $limit | float64) 1000) (float64 $limit) (hasSuffix "m" $limit)) -}}
{{- end -}}
{{- $ncpu := ternary 0.25 $ps.num_cpus (kindIs "invalid" $ps.num_cpus) -}}
{{- if and $cpu (gt (float64 $ncpu) $cores) -}}
{{- fail (printf "settings.%s.num_cpus (%v) is more than one %s pod offers Ray (%v, from its %s): the replica would never be placed; lower num_cpus or raise pools.%s.resources.limits.cpu" $p $ncpu $p $cores $cpu $p) -}}
{{- end -}}
{{- if hasKey ($g.rayStartParams | default dict) "resources" -}}
{{- fail (printf "pools.%s.rayStartParams.resources is set by the chart ({\"epd-%s\": 1}, what the pool's replicas ask for): remove it; a replica's extra resources go in settings.%s.ray_resources" $p $p $p) -}}
{{- end -}}
{{- end -}}
{{- if and (eq (.Values.settings.mode | default "disaggregated") "disaggregated") (kindIs "invalid" $s.model) (lt (int64 ($s.encode.replicas | default 0)) 1) -}}
{{- fail "settings.model is null, so the pods would serve the built-in demo model, which has a vision encoder and needs the encode pool: set settings.model to your checkpoint's folder (see modelVolume), or settings.encode.replicas to 1 or more (values-cpu.yaml runs the demo model that way)" -}}
{{- end -}}
{{- if and (not .Values.redis.enabled) (not .Values.redis.external.url) (not .Values.redis.external.existingSecret) -}}
{{- fail "redis.enabled is false: set redis.external.url, or redis.external.existingSecret and existingSecretKey" -}}
{{- end -}}
{{- $url := .Values.redis.external.url | default "" -}}
{{- if and (not .Values.redis.external.existingSecret) (or (regexMatch "^[a-zA-Z+]+://[^/?#@]*:[^/?#]*@" $url) (regexMatch "(?i)[?&]password=" $url)) -}}
{{- fail "redis.external.url holds a password, which would be a plain env value in the control plane's Deployment (readable by anyone who can read Deployments): put the whole URL in a Secret and name it in redis.external.existingSecret and existingSecretKey" -}}
{{- end -}}
{{- end -}}

{{/*
A pod annotation that changes when credentials set in values change (so the pods holding them restart),
without revealing them: anyone who may read a pod spec can read its annotations, and a plain SHA-256 of a
short password is guessed at billions a second. This is scrypt (Sprig's derivePassword: N=32768, r=8, p=2,
salted with the release's full name), then SHA-256: each guess costs about 0.1 s and 32 MiB. Generated
credentials are not in values, so they never change it. Call with (dict "root" $ "values" LIST).
*/}}
{{- define "epd.credentialsChecksum" -}}
{{- derivePassword 1 "maximum" (toJson .values) (include "epd.fullname" .root) "epd-credentials" | sha256sum -}}
{{- end -}}
